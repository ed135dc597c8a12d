#!/usr/bin/env bash
# Creates ./.venv (Python >= 3.11) with lmscale_jax and its test tools installed. Idempotent.
#
#   bash tools/setup.sh          # ./.venv: CPU jax (what the tests, the demo and CI use)
#   bash tools/setup.sh --cuda   # ./.venv-cuda: jax with CUDA 12 (pip wheels), for GPU nodes
#
# --cuda installs '.[cuda12,test]' into a separate ./.venv-cuda (LMSCALE_CUDA_VENV=DIR for
# another place; a venv cannot be moved after it is made, so create it where the GPU nodes see
# it, e.g. on the shared filesystem from a login node). It downloads ~3.3 GB of NVIDIA wheels
# (jax-cuda12-plugin/pjrt, cuBLAS, cuDNN, NCCL, cuFFT, cuSOLVER, cuSPARSE, nvJitLink, …: the
# CUDA toolkit is not needed on the machine) and needs Linux x86_64/aarch64 and, where it
# runs, an NVIDIA driver >= 525 (JAX's requirement for CUDA 12). Without a GPU here (a login
# node) it installs and says so; with one it checks that JAX runs on the GPU (an error naming
# why, never a silent CPU fallback). Then run: .venv-cuda/bin/lmscale gpu-check
set -euo pipefail
cuda=""
if [ "${1:-}" = --cuda ]; then cuda=1; shift; fi
source "$(dirname "$0")/_no_arguments.sh" "$0" "$@"  # --help, or no other argument at all
cd "$(dirname "$0")/.."
py=""
for c in python3.13 python3.12 python3.11 python3; do
  if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py=$c; break
  fi
done
[ -n "$py" ] || { echo "error: lmscale_jax needs Python >= 3.11 (python3.11+ not found on PATH)" >&2; exit 1; }
if [ -n "$cuda" ]; then
  exec bash tools/_setup_cuda.sh "$py" "${LMSCALE_CUDA_VENV:-.venv-cuda}"
fi
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.lmscale-installed
# Reinstall when the package's build inputs changed since: its metadata and dependencies, and
# the compiled extensions (an editable install builds lmscale_jax/prep/**/*.c into the source tree
# once; an edited .c is not rebuilt on import).
stale=""
for f in pyproject.toml setup.py lmscale_jax/prep/*.c lmscale_jax/prep/elf/*.c; do
  [ "$f" -nt "$stamp" ] && stale=1
done
source tools/_quiet_pip.sh
if [ ! -f "$stamp" ] || [ -n "$stale" ]; then
  echo "setup: installing lmscale_jax and its dependencies into .venv (a few minutes, once)" >&2
  quiet_pip .venv/bin/python .venv/pip-install.log --upgrade pip
  quiet_pip .venv/bin/python .venv/pip-install.log -e '.[test]'
  touch "$stamp"
fi
