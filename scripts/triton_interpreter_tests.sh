#!/usr/bin/env bash
# The paged decode attention kernel (Triton) checked on CPU under Triton's interpreter (TRITON_INTERPRET=1).
# Triton goes into its own folder ($TRITON_SITE, default ./.triton-site, gitignored), put on the path for this run
# only, so the main suite runs without it; 3.6.0 is the triton CUDA torch 2.11 ships with.
# TRITON_PREPARE_ONLY=1 installs triton and stops.
# Usage: bash scripts/triton_interpreter_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${TRITON_SITE:-.triton-site}
[ -d "$SITE/triton" ] || .venv/bin/pip --disable-pip-version-check install -q --no-deps --target "$SITE" triton==3.6.0
[ "${TRITON_PREPARE_ONLY:-0}" = 1 ] && exit 0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=1 PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -m pytest -q -p no:cacheprovider tests/engine/decode/test_paged_attention.py "$@"
