// One compilation unit for four kernels (`kernels/cpu_ops.py` builds two such units in
// parallel): torch's headers, ~15 s of every unit on a 2-core box, are parsed once per
// unit instead of once per kernel (the build went from ~70 s to ~30 s).
#include "gumbel_race.cpp"
#include "rms_norm.cpp"
#include "seeded_uniform.cpp"
#include "silu_and_mul.cpp"
