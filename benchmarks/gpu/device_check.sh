#!/usr/bin/env bash
# GPU figures for unsloth_rollout on one machine with one CUDA GPU and no network.
#
#   bash benchmarks/gpu/device_check.sh [--dry-run] VARIANT [VARIANT ...]
#   bash benchmarks/gpu/device_check.sh --fetch-wheels      (on a machine with PyPI: builds benchmarks/gpu/wheels/site.tgz)
#
# Variants (each one command; its steps' time limits add up to 510 s at most, so a call allowed 560 s returns
# what was measured even when a step hangs):
#   probe  environment, paged decode-attention probe (probe_varlen.py), tests/test_gpu.py
#   bf16   random-weight Qwen2.5-VL-3B, LoRA r=16 on vision + language layers, bf16:
#          GRPO 64 prompts x 8 samples, one image each: engine vs hf-batched; decode tok/s at batch 1/64/256
#   4bit   the same model with bitsandbytes NF4 base weights (needs the bitsandbytes wheel in wheels/)
#   text   random-weight Qwen2.5-3B text model: engine vs hf-batched vs transformers continuous batching
#   captured  the bf16 model's decode sweep twice: the eager workspace step, then the compiled step
#          (DecodeConfig(backend="compiled"): compiled at engine start; warm-up and recompiles recorded)
#   unsloth  unsloth_check.py: Unsloth's FastLanguageModel fast path refused by name (or served exactly), auto
#          loading transformers there, FastVisionModel served within bounds (needs site.tgz)
#   transfer  weight_transfer_check.py: TRL's VLLMClient pushes changed weights to the server over NCCL (trainer and
#          server share the GPU); version bump, logprobs and greedy tokens on the new weights (needs site.tgz for TRL)
#   paged  paged_attention_check.py: the Triton paged decode attention kernel against float64 and SDPA (fp32, bf16,
#          fp16) and timed against SDPA over a workspace at batch 1/64/256, contexts 128..2048 (3B-VL shape); then
#          its tests (tests/engine/decode/test_paged_attention.py, on CUDA: the engine's "paged" step included)
#   all    the decode checks in one call under 590 s: the model build in the background while
#          tests/test_gpu.py and unsloth_check.py share the GPU (correctness only), then alone on the GPU the 3B
#          VL decode sweep (eager workspace, the compiled step, HF generate() at batch 1 and 64), then the NF4
#          eager sweep if time is left
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
HF_BATCHES=${HF_BATCHES:-1,64}  # HF generate() beside the engine in the `all` sweep
PASSES=${PASSES:-2}             # the `all` sweep's passes over BATCHES per backend (the second: settled)
SWEEP=${SWEEP:-workspace,compiled,compiled@1,graph}  # the `all` sweep's decode backends (graph: the compiled
# step replayed as CUDA graphs; compiled@1: one decoder layer per compiled call, the default is units of 4; each backend's JSON
# is written as it ends, so a sweep cut by its step limit keeps the backends before)
DEADLINE=${DEADLINE:-580}       # the `all` variant starts the NF4 sweep only with more than 60 s of this left
KV=${KV:-16GiB}           # engine KV cache budget
CARRY_LIMIT=$((64 << 20))
# Wheels the device lacks (it has torch, transformers, peft, accelerate, triton, torchvision, pillow, pytest).
# bitsandbytes: 4-bit weights (43 MB; one CUDA library in it is used). xformers: paged decode fallback (3 MB).
# They travel as one archive, wheels/site.tgz (~20 MB), unpacked on the device into three folders that each step
# puts on PYTHONPATH as it needs: bnb/ (bitsandbytes, with only its CUDA 13.0 library), xf/ (xformers, the paged
# decode probe) and unsloth/ (unsloth 2026.10.9 without its "studio" web app, unsloth_zoo and what they import
# that the device lacks; the versions verified together on CPU in scripts/install.sh). Kept apart because with
# unsloth importable load_model(backend="auto") would load VLMs through Unsloth.
WHEEL_SPECS=("bitsandbytes==0.50.2" "xformers==0.0.35" "unsloth==2026.10.9" "unsloth_zoo==2026.10.9" "trl==1.16.0"
  "datasets==4.8.5" "dill==0.4.1" "multiprocess==0.70.19" "tyro==1.0.17" "docstring_parser==0.18.0"
  "typeguard==4.6.1" "msgspec==0.23.0" "hf_transfer==0.1.9" "pydantic==2.14.4" "pydantic_core==2.50.5"
  "annotated-types==0.8.0" "typing-inspection==0.4.5" "json5==0.17.3" "nest-asyncio==1.6.0" "structlog==26.1.0")
PIP_DOWNLOAD=(pip download --no-deps --python-version 3.12 --implementation cp --platform manylinux2014_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64
              --platform any --only-binary=:all:)
SITE=${SITE:-/tmp/site}

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
      tmp=$(mktemp -d)
      "${PIP_DOWNLOAD[@]}" -d "$tmp/whl" "${WHEEL_SPECS[@]}"
      mkdir -p "$tmp/site/unsloth" "$tmp/site/xf" "$tmp/site/bnb" "$WHEELS"
      for w in "$tmp"/whl/*.whl; do
        case $(basename "$w") in xformers*) d=xf ;; bitsandbytes*) d=bnb ;; *) d=unsloth ;; esac
        unzip -q -o "$w" -d "$tmp/site/$d"
      done
      rm -rf "$tmp/site/unsloth/studio"
      find "$tmp/site/bnb" -name 'libbitsandbytes_*' ! -name '*cuda130*' -delete
      tar czf "$WHEELS/site.tgz" -C "$tmp/site" unsloth xf bnb
      rm -rf "$tmp"
      ls -l "$WHEELS"; exit 0 ;;
    probe|bf16|4bit|text|captured|unsloth|transfer|paged|all) VARIANTS+=("$a") ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown argument: $a (variants: probe bf16 4bit text captured unsloth transfer paged all; options: --dry-run --fetch-wheels)" >&2; exit 2 ;;
  esac
done
[ ${#VARIANTS[@]} -gt 0 ] || { echo "name at least one variant: probe bf16 4bit text captured unsloth transfer paged all" >&2; exit 2; }

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
  if [ "${1:-}" = wheels ] && [ -f "$WHEELS/site.tgz" ]; then
    n=$((n + $(stat -c %s "$WHEELS/site.tgz")))
  fi
  echo "$n"
}

install_wheels() {  # unpack the carried archive once; each step names the folders it needs (with_site)
  if [ -f "$WHEELS/site.tgz" ]; then
    [ -d "$SITE/bnb" ] || step unpack_site 60 bash -c "mkdir -p '$SITE' && tar xzf '$WHEELS/site.tgz' -C '$SITE'"
  elif [ $DRY = 0 ]; then
    echo "no $WHEELS/site.tgz (4-bit, the xformers probe and the Unsloth checks will report themselves unavailable)"
  fi
}

site_pp() {  # site_pp "bnb xf": PYTHONPATH with those unpacked folders first (steps run: env PYTHONPATH=... CMD)
  local pp=${PYTHONPATH:-} d
  for d in $1; do pp=$SITE/$d:$pp; done
  echo "$pp"
}

LANES=()
lane() {  # lane NAME CMD...: CMD in the background, its output to $OUT/NAME.log only; inline in a dry run
  local name=$1; shift
  if [ $DRY = 1 ]; then "$@"; return 0; fi
  ( LOG=$OUT/$name.log; FAILED=(); "$@" > /dev/null; [ ${#FAILED[@]} = 0 ] ) &
  LANES+=("$name:$!")
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
      step probe_varlen 60 env PYTHONPATH="$(site_pp xf)" "$PY" "$HERE/probe_varlen.py" --json "$OUT/probe_varlen.json"
      step test_gpu 240 env PYTHONPATH="$(site_pp bnb)" "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py \
        --junitxml="$OUT/test_gpu.xml"
      ;;
    unsloth)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes wheels) bytes (tree + site.tgz) of $CARRY_LIMIT"
      install_wheels
      step unsloth_check 240 env PYTHONPATH="$(site_pp "unsloth bnb")" "$PY" "$HERE/unsloth_check.py" --models "$MODELS" \
        --json "$OUT/unsloth_check.json"
      ;;
    transfer)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes wheels) bytes (tree + site.tgz) of $CARRY_LIMIT"
      install_wheels
      step weight_transfer 240 env PYTHONPATH="$(site_pp unsloth)" "$PY" "$HERE/weight_transfer_check.py" \
        --models "$MODELS" --json "$OUT/weight_transfer.json"
      ;;
    paged)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes) bytes (tree only) of $CARRY_LIMIT"
      step paged_attention 240 "$PY" "$HERE/paged_attention_check.py" --batches "$BATCHES" --json "$OUT/paged_attention.json"
      step test_paged_attention 200 "$PY" -m pytest -q -rA -p no:cacheprovider tests/engine/decode/test_paged_attention.py \
        --junitxml="$OUT/test_paged_attention.xml"
      ;;
    all)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes wheels) bytes (tree + site.tgz) of $CARRY_LIMIT"
      T0=$SECONDS
      install_wheels
      # The 3B build (CPU and disk) runs beside the correctness lanes; the timed sweep waits for all three.
      lane build build_model qwen2_5_vl
      lane unsloth step unsloth_check 200 env PYTHONPATH="$(site_pp "unsloth bnb")" "$PY" "$HERE/unsloth_check.py" \
        --models "$MODELS" --json "$OUT/unsloth_check.json"
      step probe_varlen 45 env PYTHONPATH="$(site_pp xf)" "$PY" "$HERE/probe_varlen.py" --json "$OUT/probe_varlen.json"
      step test_gpu 220 env PYTHONPATH="$(site_pp bnb)" "$PY" -m pytest -q -rA -p no:cacheprovider tests/test_gpu.py
      for l in "${LANES[@]}"; do wait "${l#*:}" || FAILED+=("${l%%:*}_lane"); done
      LANES=()
      step decode_vl_${SIZE}_bf16 210 "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" \
        --dtype bfloat16 --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --decode-backend "$SWEEP" \
        --passes "$PASSES" --hf-batches "$HF_BATCHES" --json "$OUT/decode_vl_${SIZE}_bf16.json"
      LEFT=$((DEADLINE - (SECONDS - T0)))
      if [ $DRY = 1 ] || [ $LEFT -gt 60 ]; then
        step decode_vl_${SIZE}_4bit $([ $DRY = 1 ] && echo 100 || echo $((LEFT - 10))) env PYTHONPATH="$(site_pp bnb)" "$PY" \
          "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" --dtype bfloat16 --load-in-4bit \
          --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --decode-backend workspace,compiled \
          --json "$OUT/decode_vl_${SIZE}_4bit.json"
      else
        echo "no time left for the NF4 sweep (${LEFT}s)" | tee -a "$LOG"
      fi
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
      step decode_vl_${SIZE}_4bit 120 env PYTHONPATH="$(site_pp bnb)" "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" --dtype bfloat16 \
        --load-in-4bit --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --json "$OUT/decode_vl_${SIZE}_4bit.json"
      ;;
    captured)
      [ $DRY = 1 ] && echo "  carried: $(carried_bytes) bytes (tree only) of $CARRY_LIMIT"
      build_model qwen2_5_vl
      for DB in workspace compiled compiled@1; do
        step decode_vl_${SIZE}_bf16_${DB/@/_l} 180 "$PY" "$HERE/decode_sweep.py" --model "$MODELS/qwen2_5_vl-$SIZE" \
          --dtype bfloat16 --batches "$BATCHES" --kv-cache-memory-bytes "$KV" --decode-backend $DB \
          --json "$OUT/decode_vl_${SIZE}_bf16_${DB/@/_l}.json"
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
  [ -f "$WHEELS/site.tgz" ] || echo "no wheels/site.tgz: build it with  bash $0 --fetch-wheels"
  exit 0
fi
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "failed steps: ${FAILED[*]}"
  exit 1
fi
echo "all steps passed; results in $OUT"
