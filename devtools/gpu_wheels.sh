#!/usr/bin/env bash
# Downloads into .whl/ the wheels `devtools/gpu_session.sh` installs on a lent GPU machine:
# the packages its image lacks (structlog, ucxx-cu12 and its UCX/RMM libraries) or holds at
# versions our generated code refuses (protobuf, grpcio). CPython 3.12, x86-64. The wheels
# (58 MB) plus the tree outgrew the device tool's 64 MiB, so they travel unpacked as one
# xz tarball, .whl/site.tar.xz (34 MB; none has a .data folder, so unzipping installs them).
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
  rapids-logger==0.3.0 librmm-cu12==26.10.0 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
rm -rf .whl/site && mkdir .whl/site
for w in .whl/*.whl; do unzip -qo "$w" -d .whl/site; done
tar -C .whl/site -cJf .whl/site.tar.xz . && rm -rf .whl/site .whl/*.whl
du -sh .whl
