// The sampler's 32-bit avalanche hash (hash-prospector's [16 21f0aaad 15 735a2d97 15]), as
// services/worker/seeded_noise.py `mix32_` computes it: shared by the kernels that draw the
// counter-based uniforms (seeded_uniform.cpp, gumbel_race.cpp), so both hash alike.

#pragma once

#include <cstdint>

namespace tandem_cpu {

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

}  // namespace tandem_cpu
