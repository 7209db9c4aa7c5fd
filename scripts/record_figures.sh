#!/usr/bin/env bash
# Refresh the figures recorded under benchmarks/ by the tests that measure them (reliability and learning runs).
# Tests write to the ignored .figures/ folder by default; this points them at benchmarks/ instead.
#   bash scripts/record_figures.sh            # CI-length variants
#   bash scripts/record_figures.sh -m slow    # full-length variants
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false UNSLOTH_ROLLOUT_FIGURES="$PWD/benchmarks"
.venv/bin/python -m pytest -q -p no:cacheprovider "${@:--m not slow}" \
  tests/test_reliability_load.py tests/test_reliability_faults.py tests/test_reliability_fuzz.py \
  tests/test_reliability_grpo.py tests/test_areal_grpo_learning.py
