#!/usr/bin/env bash
# The GPU check for issue "GPU path", prepared to run once on the lent device machine (one GPU, no network).
# Run from the repository root: bash benchmarks/gpu/device_check.sh   (results go to $OUT, default benchmarks/gpu/out)
#
# The device already has torch (CUDA), transformers 5.17, peft, accelerate, safetensors, tokenizers, pillow, numpy,
# triton and pytest. What it lacks travels as wheels in wheels/ (carry it; 64 MiB per call, see README.md here):
#   call 1: unsloth-2026.10.9 (16 MB), unsloth_zoo-2026.10.9 (24 MB), xformers (3.3 MB)
#   call 2: bitsandbytes-0.50.2 (43 MB; or a slimmed copy with one CUDA library)
set -euo pipefail
OUT=${OUT:-benchmarks/gpu/out}
mkdir -p "$OUT" /tmp/models
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
if ls wheels/*.whl >/dev/null 2>&1; then
  pip install --no-deps --no-index wheels/*.whl 2>&1 | tail -2
fi
python - <<'PY' | tee "$OUT/env.txt"
import torch, transformers, importlib.util as u
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, "| unsloth", bool(u.find_spec("unsloth")),
      "| bitsandbytes", bool(u.find_spec("bitsandbytes")))
PY
# 1. Parity on the GPU (bf16/fp32 per test; tolerances in README.md), engine-level tests only.
timeout 180 python -m pytest -q -x tests/test_engine_parity.py tests/test_engine_compile.py \
  --junitxml="$OUT/parity.xml" 2>&1 | tail -5 || true
# 2. Real-dimension random models, built on the GPU in bf16.
python -m unsloth_rollout.testing.tiny --arch qwen2_5_vl --size 3b --out /tmp/models/q3b
# 3. Bench: engine vs hf-batched (and vllm when present) on the GRPO workload with vision LoRA, 16-bit and 4-bit.
for q in 16bit 4bit; do
  extra=""; [ "$q" = 4bit ] && extra="--load-in-4bit"
  timeout 240 python -m unsloth_rollout.bench --model /tmp/models/q3b --workload grpo --prompts 16 --group 8 \
    --max-new-tokens 256 --backends engine,hf-batched,vllm --lora-rank 16 $extra --no-progress \
    --json "$OUT/bench_q3b_$q.json" --markdown "$OUT/bench_q3b_$q.md" 2>&1 | tail -25 || true
done
