#!/usr/bin/env bash
# Smoke run on the NEWEST transformers / peft that pip resolves today (the pinned, verified line is install.sh's).
# Creates $VENV (default ./.venv-newest, gitignored) with torch 2.13.0 (CPU) and whatever transformers, peft,
# accelerate, ... pip picks now, installs unsloth_rollout into it (--no-deps, editable), prints the versions,
# then runs the tests marked `smoke` (engine greedy parity vs HF generate() on text families + a VLM) on two
# pytest-xdist workers. SMOKE_PREPARE_ONLY=1 builds the venv and stops (.ci/run builds it beside the main suite).
# Usage: bash scripts/smoke_newest.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv-newest}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check"
# --upgrade: a venv kept from an earlier run moves to what pip resolves today. torch is named, pinned, so pip
# takes the CPU wheel instead of resolving a multi-GB CUDA build.
$PIP install -q --upgrade torch==2.13.0 transformers peft accelerate safetensors tokenizers pillow numpy pytest \
  pytest-timeout pytest-xdist gguf
$PIP install -q --no-deps -e .
# A torchvision beside the CPU torch cannot import and breaks transformers' Qwen2-VL processors.
if "$VENV/bin/python" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torchvision') else 1)"; then
  $PIP uninstall -q -y torchvision
fi
"$VENV/bin/python" -c "import torch, transformers, peft; print('smoke on newest: torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
[ "${SMOKE_PREPARE_ONLY:-0}" = 1 ] && exit 0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" -m pytest -q -m smoke -p no:cacheprovider -n 2 --dist loadfile "$@"
