#!/usr/bin/env bash
# Check that unsloth_rollout works where torchvision is installed (GPU machines usually have it; the CPU line
# that scripts/install.sh builds removes it, because PyPI's torchvision cannot import beside a CPU-only torch).
#
#   bash scripts/check_torchvision.sh [VENV]        (default VENV: .venv-tv, ignored by git)
#
# It builds VENV with a matching torch + torchvision pair (a CUDA build: ~5.5 GB, runs on CPU),
# transformers 5.17.0, peft 0.18.1 and accelerate, installs this package --no-deps -e, prints which
# processor each VLM fixture gets (with torchvision, transformers' AutoProcessor returns the stock
# processors with torchvision-backed image processors; Qwen3-VL fixtures, which have no video
# processor config, fall back to the image-only processor), and runs the engine parity tests and the
# Qwen3-VL / Gemma 3 family tests there. Tiny models are built into a separate cache (VENV/cache) so the
# CPU line's cache is not touched.
#
# Not part of CI (the download is too large for it). Versions: TORCH / TORCHVISION env vars (defaults:
# the newest pair this machine's pip allows).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-tv}
TORCH=${TORCH:-2.14.1}
TORCHVISION=${TORCHVISION:-0.29.1}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VENV=$(cd "$VENV" && pwd)
PIP="$VENV/bin/pip --disable-pip-version-check"
$PIP install -q "torch==$TORCH" "torchvision==$TORCHVISION" transformers==5.17.0 peft==0.18.1 accelerate==1.15.0 \
  safetensors tokenizers numpy "pillow>=12.1.1" pytest pytest-timeout hypothesis
$PIP install -q --no-deps -e .

export UNSLOTH_ROLLOUT_CACHE=$VENV/cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/python" - <<'PY'
import importlib, inspect
import torch, torchvision, transformers
from unsloth_rollout.models.processor import load_processor
from unsloth_rollout.testing.tiny import tiny_model_path
from unsloth_rollout.testing.vlm_families import VLM_FAMILIES, vlm_family_path

print(f"torch {torch.__version__} | torchvision {torchvision.__version__} | transformers {transformers.__version__}")
paths = {a: tiny_model_path(a) for a in ("qwen2_vl", "qwen2_5_vl")}
paths.update({f: vlm_family_path(f) for f in VLM_FAMILIES})
for name, path in paths.items():
    proc = load_processor(path)
    print(f"  {name:11s} {type(proc).__name__:27s} image processor {type(proc.image_processor).__name__}")
PY
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_engine_parity.py tests/test_vlm_families.py \
  -k "test_engine_parity or qwen3_vl or gemma3"
