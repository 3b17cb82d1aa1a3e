#!/usr/bin/env bash
# Would a lab's outputs stored from another preset, as a GPU run stores them (`small`), still pass
# strict nbval on a CPU, where the labs pick `tiny`? Executes the named labs with GPULAB_PRESET=$PRESET
# in a scratch copy of the working tree (tools/gpu_run.py, so a failing lab is stored with its error),
# then runs nbval there with no preset set. The repository itself is not touched.
#
#   tools/preset-check.sh 04 09                  # PRESET=small by default
#   PRESET=1b LAB_TIMEOUT=3600 tools/preset-check.sh 01
#
# On a CPU the `small` preset is slow (lab 6 takes more than 15 minutes) and lab 4's model section
# needs more than 24 GB; a cell that fails here because of its preset's size says nothing about nbval.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: tools/preset-check.sh LAB... (numbers like 04)" >&2; exit 2; }
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || { echo "preset-check: no $python; run make install first, or set PYTHON" >&2; exit 2; }
python=$(realpath -s "$python")  # the venv's python by its own path: its symlink leads out of the venv

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/repo"
git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$scratch/repo"
cd "$scratch/repo"

labs=()
for n in "$@"; do labs+=("$(ls labs/"$n"-*.ipynb)"); done
status=0
limit_s=${LAB_TIMEOUT:-1800}
# labs run one after another here: the run's deadline (gpu_run's default, an hour) must not cut a lab short
GPULAB_PRESET=${PRESET:-small} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$python" tools/gpu_run.py \
    "$@" --lab-timeout "$limit_s" --deadline "$((limit_s * $# + 60))" --log "$scratch/run.json" || status=$?
echo "preset-check: executed with GPULAB_PRESET=${PRESET:-small} (exit status $status); nbval with the default preset:"
env -u GPULAB_PRESET "$python" -m pytest --nbval "${labs[@]}" -q -n 0 -p no:cacheprovider || status=1
exit $status
