#!/usr/bin/env bash
# Fills .gpu/ (git-ignored) with what tools/bench_gpu.sh needs on a GPU machine that has no
# package index: wheels of the Python packages its image lacks, and the peer benchmark.
#
#   bash tools/fetch_gpu_wheels.sh      # here, with network; then carry .gpu to the GPU call
#
# The image (see the device notes) has Python 3.12, jax/jaxlib (CUDA), flax, optax,
# orbax-checkpoint, etils, absl-py, cloudpickle, protobuf, PyYAML, psutil, tokenizers, torch
# and transformers; it lacks grain (+ portpicker), array-record, ml-collections and
# tensorboardX (and pytest, for the GPU-only tests bench_gpu.sh runs). Wheels are fetched without dependencies, for that interpreter, at the
# versions this repository is tested with; one version of each.
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
  portpicker==1.6.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
for peer in ../shared/bench/peer_hf_bert.py /work/shared/bench/peer_hf_bert.py; do
  if [ -f "$peer" ]; then install -m 644 "$peer" .gpu/peer_hf_bert.py; break; fi
done
[ -f .gpu/peer_hf_bert.py ] || echo "warning: peer_hf_bert.py not found (../shared/bench)" >&2
ls -l .gpu/wheels .gpu/peer_hf_bert.py
du -sh .gpu
