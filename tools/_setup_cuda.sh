# `bash tools/setup.sh --cuda` (see its header): bash tools/_setup_cuda.sh PYTHON VENV_DIR
# A separate venv, not ./.venv: the CPU venv stays what the tests, the demo and CI run (1 GB,
# no CUDA plugin probing for a GPU at every start), and on a machine without a GPU the CUDA
# plugin would only warn and fall back to the CPU -- the silent fallback this must not allow.
set -euo pipefail
py=$1 venv=$2
MIN_DRIVER=525  # JAX's installation guide: driver >= 525 for CUDA 12 on Linux
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64|Linux-aarch64) ;;
  *) echo "error: --cuda needs Linux x86_64 or aarch64 (JAX's CUDA wheels exist only there;" \
          "this is $(uname -s) $(uname -m)); use bash tools/setup.sh for the CPU" >&2; exit 1 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp=$venv/.lmscale-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing lmscale_jax[cuda12,test] into $venv: ~3.3 GB of NVIDIA CUDA wheels on a" \
       "first run (a few minutes)"
  t0=$SECONDS
  # No pip cache unless one is configured: a 3 GB copy in ~/.cache fills a cluster home quota.
  nocache=--no-cache-dir
  [ -n "${PIP_CACHE_DIR:-}" ] && nocache=""
  "$venv/bin/python" -m pip install -q $nocache --upgrade pip
  "$venv/bin/python" -m pip install -q $nocache -e '.[cuda12,test]'
  touch "$stamp"
  echo "installed in $((SECONDS - t0)) s; $venv holds $(du -sh "$venv" | cut -f1)"
fi
"$venv/bin/python" - <<'EOF'
from importlib import metadata
names = ["jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-runtime-cu12",
         "nvidia-cudnn-cu12", "nvidia-nccl-cu12", "nvidia-cublas-cu12"]
def version(n):
  try:
    return metadata.version(n)
  except metadata.PackageNotFoundError:
    return "missing"
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
# JAX's guide: LD_LIBRARY_PATH can make it load other CUDA libraries than the pip wheels'.
for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }}; do
  if compgen -G "$d/libcudnn*" >/dev/null || compgen -G "$d/libcublas*" >/dev/null \
     || compgen -G "$d/libnccl*" >/dev/null; then
    echo "warning: LD_LIBRARY_PATH holds CUDA libraries ($d): they can shadow the pip wheels'" \
         "(unset LD_LIBRARY_PATH or 'module unload cuda' before running lmscale_jax)" >&2
    break
  fi
done
driver=""
if [ -r /proc/driver/nvidia/version ]; then
  driver=$(grep -oE '\b[0-9]{3,}\.[0-9]+(\.[0-9]+)?\b' /proc/driver/nvidia/version | head -1 || true)
fi
if [ -z "$driver" ] && command -v nvidia-smi >/dev/null; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
fi
if [ -z "$driver" ]; then
  echo "no NVIDIA driver on this machine (no /proc/driver/nvidia/version, no nvidia-smi):" \
       "installed for the GPU nodes, which need driver >= $MIN_DRIVER. On one, first run:" \
       "$venv/bin/lmscale gpu-check"
  exit 0
fi
if [ "${driver%%.*}" -lt "$MIN_DRIVER" ]; then
  echo "error: NVIDIA driver $driver is older than $MIN_DRIVER, the oldest JAX's CUDA 12 wheels" \
       "support (docs.jax.dev installation guide): ask for a newer driver, or install NVIDIA's" \
       "CUDA forward-compatibility package" >&2
  exit 1
fi
# JAX's CUDA devices, or why there are none (gpu_env asks for "cuda" devices: an error, never
# the CPU fallback JAX takes on its own).
if ! out=$("$venv/bin/python" -c '
import sys
from lmscale_jax.gpu import env as gpu_env
devices, why = gpu_env.gpu_devices()
print(f"{len(devices)} x {devices[0].device_kind}" if devices else why)
sys.exit(0 if devices else 1)' 2>/dev/null); then
  echo "error: NVIDIA driver $driver is present but JAX cannot use a GPU: $out" >&2
  exit 1
fi
echo "JAX runs on $out (driver $driver). Next: $venv/bin/lmscale gpu-check"
