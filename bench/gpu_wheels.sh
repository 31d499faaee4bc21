#!/usr/bin/env bash
# The wheels bench/gpu_check.sh installs on the device machine, which reaches no package index:
# what zengine needs beyond that machine's image (pydantic and its own needs, hjson) into .whl/,
# and DeepSpeed, bench_gpu_step's peer, into .whl/peers/ (a pure-Python wheel built here from its
# source release; its CUDA ops are compiled there, on first use). The machine runs CPython 3.12
# on x86-64. Run from the repository root, where .git/info/exclude lists /.whl/.
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0 hjson==3.1.0
# DeepSpeed's setup.py imports torch: build with an interpreter that has it (TORCH_PYTHON)
source=$(mktemp -d)
"$PY" -m pip download -q --no-deps --no-binary=:all: -d "$source" deepspeed==0.19.8
DS_BUILD_OPS=0 "${TORCH_PYTHON:-$PY}" -m pip wheel -q --no-deps --no-build-isolation \
    -w .whl/peers "$source"/deepspeed-0.19.8.tar.gz
rm -r "$source"
ls -l .whl .whl/peers
