#!/usr/bin/env bash
# Downloads into .whl/ the wheels `devtools/gpu_session.sh` installs on a lent GPU machine:
# the packages its image lacks (structlog, ucxx-cu12 and its UCX/RMM libraries) or holds at
# versions our generated code refuses (protobuf, grpcio). CPython 3.12, x86-64; about 58 MB
# of the device tool's 64 MiB (so transformers, 13 MB, is not carried: the image has 5.17).
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
plat=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  plat+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl \
  protobuf==7.36.2 grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
  structlog==26.1.0 ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 \
  rapids-logger==0.3.0 librmm-cu12==26.10.0
du -sh .whl
