#!/usr/bin/env bash
# Run the labs on an offline GPU machine with its own python and torch (no network, no make):
#   1. where wheels were carried in .whl/ (made on a networked machine by tools/gpu-wheels.sh),
#      install them into $GPU_RUN_SITE without network, if something is missing;
#   2. put the repo and those packages on PYTHONPATH (lab kernels and torchrun children import gpulab);
#   3. execute the labs in place through tools/gpu_run.py, which logs each lab and packs an archive.
# Usage, from anywhere:  tools/gpu-run.sh [labs...] [--lane 00,02 ...] [--lab-timeout S] [--deadline S]
#                                         [--archive FILE.tar.gz] [--log FILE.json]
# GPULAB_PRESET and GPULAB_DEVICE pass through (GPULAB_DEVICE=cpu runs the same labs on the CPU).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="${PYTHON:-python3}"
site="${GPU_RUN_SITE:-/tmp/gpu-run-site}"   # where carried wheels are installed
wheels="${GPU_RUN_WHEELS:-$root/.whl}"     # the carried wheels

# gloo over loopback (the machine may have no routable interface); never reach for the Hub
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg PYTHONFAULTHANDLER=1  # a crashing kernel prints its stack
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

missing() {
  "$python" - <<'PY'
import importlib.util
need = ["torch", "transformers", "peft", "bitsandbytes", "nbclient", "nbformat", "ipykernel", "ipywidgets",
        "matplotlib"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
}
# install the carried wheels only where something is missing (a full environment needs none)
if [ -n "$(missing)" ] && compgen -G "$wheels/*.whl" >/dev/null; then
  mkdir -p "$site"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$site:$PYTHONPATH"
fi
still=$(missing)
if [ -n "$still" ]; then
  echo "gpu-run: missing packages: $still. Carry their wheels in .whl/ (tools/gpu-wheels.sh) or pip install them." >&2
  exit 2
fi
GPU_RUN_ENTRY=tools/gpu-run.sh exec "$python" "$root/tools/gpu_run.py" "$@"  # the log names the wrapper
