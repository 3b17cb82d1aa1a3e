#!/usr/bin/env bash
# On a machine with network: download into .whl/ the wheels an offline GPU machine needs to run
# tools/gpu-run.sh beside its own python 3.12, torch, transformers, peft, triton, numpy and matplotlib
# (bitsandbytes, ninja, and nbclient/ipykernel/ipywidgets with their dependencies). Carry .whl/ along with
# the repo; tools/gpu-run.sh installs it without network. Extra wheels: tools/gpu-wheels.sh name==ver
# (each without its dependencies). PY_VERSION picks the target python (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
mkdir -p "$dest"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --only-binary=:all: --python-version "${PY_VERSION:-3.12}" \
          --implementation cp "${plat[@]}" -d "$dest" "$@"; }
get -c constraints.txt nbval ipykernel nbclient ipywidgets   # with their dependencies
get --no-deps -c constraints.txt bitsandbytes                # its torch and numpy are the machine's
get --no-deps -c constraints.txt ninja                       # lab 4 builds its kernels with it
[ $# -eq 0 ] || get --no-deps "$@"
# what a CUDA image with torch already has (its own versions must stay the ones imported);
# jsonschema, referencing, rpds-py and platformdirs are often missing there: keep them
for have in pytest pluggy iniconfig packaging pygments psutil typing_extensions attrs python_dateutil \
            coverage six numpy; do
  rm -f "$dest"/${have}-[0-9]*.whl
done
# what the labs never import, though ipykernel and ipywidgets name it (12 MB): the debugger (debugpy),
# IPython's completion (jedi, parso), the classic notebook's widget files, and zoneinfo's fallback data
# (Linux has its own). Without them the carried tree stays under the 64 MiB a device call may carry.
for unused in debugpy jedi parso widgetsnbextension tzdata; do
  rm -f "$dest"/${unused}-[0-9]*.whl
done
ls "$dest" | wc -l
# the working tree that travels (tracked and untracked-but-not-ignored files) plus the wheels
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
wheel_bytes=$(du -cb "$dest"/*.whl | tail -1 | cut -f1)
limit_bytes=$((64 * 1024 * 1024))
total_bytes=$((tree_bytes + wheel_bytes))
echo "gpu-wheels: $((wheel_bytes / 1000000)) MB of wheels + $((tree_bytes / 1000000)) MB of repository =" \
     "$((total_bytes / 1000000)) MB of the $((limit_bytes / 1000000)) MB (64 MiB) a device call carries"
if [ "$total_bytes" -gt "$limit_bytes" ]; then
  echo "gpu-wheels: too big to carry: leave untracked files out or drop a wheel the labs do not import" >&2
  exit 1
fi
