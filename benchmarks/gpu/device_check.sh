#!/usr/bin/env bash
# GPU figures for unsloth_rollout on one machine with one CUDA GPU and no network.
#
#   bash benchmarks/gpu/device_check.sh [--dry-run] VARIANT [VARIANT ...]
#   bash benchmarks/gpu/device_check.sh --fetch-wheels      (on a machine with PyPI: fill benchmarks/gpu/wheels/)
#
# Variants (each one command; its steps' time limits add up to 510 s at most, so a call allowed 560 s returns
# what was measured even when a step hangs):
#   probe  environment, paged decode-attention probe (probe_varlen.py), tests/test_gpu.py
#   bf16   random-weight Qwen2.5-VL-3B, LoRA r=16 on vision + language layers, bf16:
#          GRPO 64 prompts x 8 samples, one image each: engine vs hf-batched; decode tok/s at batch 1/64/256
#   4bit   the same model with bitsandbytes NF4 base weights (needs the bitsandbytes wheel in wheels/)
#   text   random-weight Qwen2.5-3B text model: engine vs hf-batched vs transformers continuous batching
#   captured  the bf16 model's decode sweep twice: the eager workspace step, then the captured step
#          (decode_backend="static": compiled at engine start; warm-up and recompiles recorded)
#
# --dry-run prints the commands a variant would run and the size of what the call carries (the working
# tree plus wheels/), against the 64 MiB a call may carry; it runs nothing else and needs no GPU.
#
# Results go to $OUT (default benchmarks/gpu/out): env.txt, one log per variant (VARIANT.log) and one JSON per
# measurement, at most four files per variant (the device returns at most 8 files per call). Model folders
# are built under $MODELS (default /tmp/models) the first time a variant needs them.
#
# Smaller runs, e.g. a smoke test of the script itself on CPU:
#   SIZE=tiny PROMPTS=2 MAX_NEW=8 BATCHES=1,4 KV=64MiB bash benchmarks/gpu/device_check.sh bf16
set -euo pipefail
cd "$(dirname "$0")/../.."

HERE=benchmarks/gpu
WHEELS=$HERE/wheels
OUT=${OUT:-$HERE/out}
MODELS=${MODELS:-/tmp/models}
PY=${PYTHON:-python3}
SIZE=${SIZE:-3b}          # model dimensions (unsloth_rollout.testing.tiny sizes)
PROMPTS=${PROMPTS:-64}    # GRPO prompts (x 8 samples each)
MAX_NEW=${MAX_NEW:-128}   # GRPO output budget
BATCHES=${BATCHES:-1,64,256}
KV=${KV:-16GiB}           # engine KV cache budget
CARRY_LIMIT=$((64 << 20))
# Wheels the device lacks (it has torch, transformers, peft, accelerate, triton, torchvision, pillow, pytest).
# bitsandbytes: 4-bit weights (43 MB; one CUDA library in it is used). xformers: paged decode fallback (3 MB).
WHEEL_SPECS=("bitsandbytes==0.50.2" "xformers==0.0.35")
PIP_DOWNLOAD=(pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64
              --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$WHEELS")

# GRPO workload: 64 prompts x 8 samples, an image on every prompt; hf-batched runs 16 groups (128 rows)
# per generate() call so that it finishes inside the variant's budget.
GRPO_ARGS="--workload grpo --prompts $PROMPTS --group 8 --max-new-tokens $MAX_NEW --lora-rank 16 --hf-batch-groups 16
  --drift-samples 16 --kv-cache-memory-bytes $KV --no-progress"

DRY=0
VARIANTS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    --fetch-wheels)
      mkdir -p "$WHEELS"
      "${PIP_DOWNLOAD[@]}" "${WHEEL_SPECS[@]}"
      ls -l "$WHEELS"; exit 0 ;;
    probe|bf16|4bit|text|captured) VARIANTS+=("$a") ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "unknown argument: $a (variants: probe bf16 4bit text captured; options: --dry-run --fetch-wheels)" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || { echo "name at least one variant: probe bf16 4bit text captured" >&2; exit 2; }

# step NAME SECONDS CMD...: run CMD under a time limit, its output appended to $OUT/VARIANT.log; a failure is recorded
# and the next step still runs (each step's figures are worth keeping on their own).
FAILED=()
step() {
  local name=$1 limit=$2; shift 2
  if [ $DRY = 1 ]; then
    printf '  [%4ss] %s\n' "$limit" "$*"
    BUDGET=$((BUDGET + limit))
    return 0
  fi
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)" | tee -a "$LOG"
  local t0=$SECONDS rc
  set +e
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  set -e
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [ $rc = 0 ] || FAILED+=("$name(rc=$rc)")
}

carried_bytes() {  # what travels: tracked and untracked-not-ignored files, plus the wheels when carried
  local n
  n=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s+=$1} END {print s+0}')
  if [ "${1:-}" = wheels ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    n=$((n + $(stat -c %s "$WHEELS"/*.whl | awk '{s+=$1} END {print s+0}')))
  fi
  echo "$n"
}

install_wheels() {  # the carried wheels, offline; pip reports what it could not install
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    step install_wheels 30 "$PY" -m pip install --no-deps --no-index --disable-pip-version-check "$WHEELS"/*.whl
  elif [ $DRY = 0 ]; then
    echo "no wheels in $WHEELS (4-bit and the xformers probe will report themselves unavailable)"
  fi
}

build_model() {  # build_model ARCH: random weights at Qwen2.5(-VL)-3B's real dimensions, bf16, once per machine
  local arch=$1
  if [ $DRY = 0 ] && [ -f "$MODELS/${arch}-$SIZE/unsloth_rollout_tiny.json" ]; then return 0; fi
  step "build_${arch}_$SIZE" 120 "$PY" -m unsloth_rollout.testing.tiny --arch "$arch" --size "$SIZE" \
    --out "$MODELS/${arch}-$SIZE"
}

bench() {  # bench NAME MODEL_DIR BACKENDS [EXTRA ARGS]
  local name=$1 model=$2 backends=$3; shift 3
  # shellcheck disable=SC2086
  step "$name" 240 "$PY" -m unsloth_rollout.bench --model "$model" --backends "$backends" $GRPO_ARGS "$@" \
    --json "$OUT/$name.json"
}

if [ $DRY = 0 ]; then
  mkdir -p "$OUT" "$MODELS"
  export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
  "$PY" - <<'PY' | tee "$OUT/env.txt"
import importlib.util as u
import torch, transformers
print("torch", torch.__version__, "| cuda", torch.version.cuda, "|",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
print("transformers", transformers.__version__, "|", ", ".join(
    f"{m} {'yes' if u.find_spec(m) else 'no'}" for m in ("torchvision", "bitsandbytes", "xformers", "unsloth")))
PY
fi

for v in "${VARIANTS[@]}"; do
  echo "## variant $v"
  LOG=$OUT/$v.log
  BUDGET=0
  case "$v" in
    probe)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes wheels) bytes (tree + wheels) of $CARRY_LIMIT"
      install_wheels
      step probe_varlen 60 "$PY" "$HERE/probe_varlen.py" --json "$OUT/probe_varlen.json"
      step test_gpu 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py --junitxml="$OUT/test_gpu.xml"
      ;;
    bf16)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes) bytes (tree only) of $CARRY_LIMIT"
      build_model qwen2_5_vl
      bench bench_vl_${SIZE}_bf16 "$MODELS/qwen2_5_vl-$SIZE" engine,hf-batched --dtype bfloat16
      step decode_vl_${SIZE}_bf16 120 "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" --dtype bfloat16 \
        --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --json "$OUT/decode_vl_${SIZE}_bf16.json"
      ;;
    4bit)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes wheels) bytes (tree + wheels) of $CARRY_LIMIT"
      install_wheels
      build_model qwen2_5_vl
      bench bench_vl_${SIZE}_4bit "$MODELS/qwen2_5_vl-$SIZE" engine,hf-batched --dtype bfloat16 --load-in-4bit
      step decode_vl_${SIZE}_4bit 120 "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" --dtype bfloat16 \
        --load-in-4bit --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --json "$OUT/decode_vl_${SIZE}_4bit.json"
      ;;
    captured)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes) bytes (tree only) of $CARRY_LIMIT"
      build_model qwen2_5_vl
      for DB in workspace static; do
        step decode_vl_${SIZE}_bf16_$DB 180 "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" \
          --dtype bfloat16 --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --decode-backend $DB \
          --json "$OUT/decode_vl_${SIZE}_bf16_$DB.json"
      done
      ;;
    text)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes) bytes (tree only) of $CARRY_LIMIT"
      build_model qwen2
      bench bench_text_${SIZE}_bf16 "$MODELS/qwen2-$SIZE" engine,hf-batched,transformers-cb --dtype bfloat16
      ;;
  esac
  [ $DRY = 1 ] && echo "  worst case (sum of step limits): ${BUDGET}s"
done

if [ $DRY = 1 ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 || echo "wheels/ is empty: fetch with  bash $0 --fetch-wheels  (${WHEEL_SPECS[*]})"
  exit 0
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed steps: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed; results in $OUT"
