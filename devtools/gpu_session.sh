#!/usr/bin/env bash
# One device call on a lent GPU machine (docs/performance.md, "GPU"): unpacks the wheels in
# .whl/site.tar.xz (devtools/gpu_wheels.sh makes it), then runs bench.gpu
# and the GPU tests, each under its own time limit, logging under $OUT.
#   usage (device tool, carry [".whl"]): bash devtools/gpu_session.sh [bench_s] [tests_s] [pytest args...]
set -u
BENCH_S=${1:-200}; TESTS_S=${2:-250}; shift 2 2>/dev/null || shift $#
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz || exit 1
for w in .whl/*.whl; do [ -e "$w" ] && python3 -m zipfile -e "$w" /tmp/site; done  # any added since
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, triton, transformers, grpc, google.protobuf as pb; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'grpc', grpc.__version__, 'protobuf', pb.__version__)"
python3 -c "import ucxx; print('ucxx', ucxx.__version__)" 2>&1 | tail -1
if [ "$BENCH_S" -gt 0 ]; then
  timeout "$BENCH_S" python3 -m bench.gpu --out "$OUT/gpu.json" 2>&1 | tee "$OUT/bench.log" | tail -40
  echo "bench rc=${PIPESTATUS[0]}"
fi
if [ "$TESTS_S" -gt 0 ]; then
  ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(tests/gpu/test_triton_kernels.py \
    tests/gpu/test_cuda_graphs.py tests/gpu/test_e2e_gpu.py tests/gpu)
  timeout "$TESTS_S" python3 -m pytest -q -p no:cacheprovider --timeout 150 \
    --junitxml "$OUT/junit.xml" "${ARGS[@]}" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -30
fi
