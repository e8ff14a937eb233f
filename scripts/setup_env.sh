#!/usr/bin/env bash
# Create ./.venv with pretrainer installed (editable) and, unless torch is already there, a torch build that fits
# the machine: the CPU build 2.13.0 where no NVIDIA GPU is visible, the default (CUDA) build otherwise.
# Reruns are no-ops while pyproject.toml and the extras are unchanged.
#   EXTRAS=test    extras to install (default: none)
#   TORCH_SPEC=... the torch requirement to install instead of the default choice
#   VENV=path      where the environment lives (default: .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.pretrainer-setup"
want="$(sha256sum pyproject.toml | cut -c1-16) extras=$EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if [ -z "${TORCH_SPEC:-}" ]; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            TORCH_SPEC="torch>=2.6"
        else
            TORCH_SPEC="torch==2.13.0"
        fi
    fi
    echo "installing $TORCH_SPEC into $VENV"
    "${pip[@]}" install "$TORCH_SPEC"
fi
target="."
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
echo "installing pretrainer${EXTRAS:+[$EXTRAS]} into $VENV"
"${pip[@]}" install -e "$target"
echo "$want" > "$stamp"
