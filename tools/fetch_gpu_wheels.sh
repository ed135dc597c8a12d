#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what tools/bench_gpu.sh needs on a GPU machine that has no
# package index: wheels of the Python packages its image lacks, and the peer benchmark.
#
#   bash tools/fetch_gpu_wheels.sh      # here, with network; then carry .gpu to the GPU call
#
# The image (see the device notes) has Python 3.12, jax/jaxlib (CUDA), flax, optax,
# orbax-checkpoint, etils, absl-py, cloudpickle, protobuf, PyYAML, psutil, tokenizers, torch
# and transformers; it lacks grain (+ portpicker), array-record, ml-collections and
# tensorboardX (and pytest, for the GPU-only tests bench_gpu.sh runs), and what lmscale index
# and serve import (its 2026-11-17 package list has none of them): pyelftools and iced-x86 (the
# ELF reader and decoder; capstone, the compiled pretokenizer's), FastAPI with starlette and
# pydantic, uvicorn with httptools, python-multipart, orjson. Without those, bench_gpu.sh's
# index, serve tests and serve benchmark would each stop at an import (6 MB of wheels). Not
# faiss-cpu (25 MB): only an index of many functions searches through it. Wheels are fetched
# without dependencies, for that interpreter, at the versions this repository is tested with;
# one version of each.
set -euo pipefail
source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"  # --help, or no arguments at all
cd "$(dirname "$0")/.."
PYVER=${GPU_PYTHON_VERSION:-3.12}
if [ -z "${PIP:-}" ]; then
  if [ -x .venv/bin/python ]; then PIP=".venv/bin/python -m pip"; else PIP="python3 -m pip"; fi
fi
mkdir -p .gpu/wheels
rm -f .gpu/wheels/*.whl
$PIP download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .gpu/wheels \
  grain==0.2.18 array-record==0.8.6 ml-collections==1.1.0 tensorboardX==2.6.5 \
  portpicker==1.6.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
  pyelftools==0.33 iced-x86==1.21.0 capstone==5.0.9 fastapi==0.165.0 starlette==1.10.0 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  uvicorn==0.55.0 httptools==0.9.0 python-multipart==0.0.34 orjson==3.13.0
for peer in ../shared/bench/peer_hf_bert.py /work/shared/bench/peer_hf_bert.py; do
  if [ -f "$peer" ]; then install -m 644 "$peer" .gpu/peer_hf_bert.py; break; fi
done
[ -f .gpu/peer_hf_bert.py ] || echo "warning: peer_hf_bert.py not found (../shared/bench)" >&2
ls -l .gpu/wheels .gpu/peer_hf_bert.py
du -sh .gpu
