"""Stop conditions: EOS (kept, "stop"), stop ids, stop strings, max_new_tokens ("length"), min_new_tokens,
ignore_eos. The reference sequence is the free-running greedy output of HF generate."""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model

PROMPT = "Alice and Bob count the red apples"
MAX = 24


@pytest.fixture(scope="module")
def setup(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers")
    ids = policy.tokenizer.encode(PROMPT)
    ref = policy.model.generate(torch.tensor([ids]), max_new_tokens=MAX, do_sample=False)[0, len(ids):].tolist()
    assert len(ref) == MAX
    # A token that first appears a few steps in, to act as a stop id or EOS.
    k = next(i for i in range(3, MAX) if ref[i] not in ref[:i])
    return policy, ids, ref, k


def run(policy, ids, eos=None, **sp):
    if eos is not None:
        policy.base_model.generation_config.eos_token_id = eos
    try:
        engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
        out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(temperature=0, **sp))])[0]
        engine.shutdown()
        return out
    finally:
        policy.base_model.generation_config.eos_token_id = [policy.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                                             policy.tokenizer.convert_tokens_to_ids("<|endoftext|>")]


def test_max_new_tokens_is_length(setup):
    policy, ids, ref, _ = setup
    out = run(policy, ids, max_new_tokens=10)
    assert out.output_ids == ref[:10] and out.finish_reason == "length" and out.stop_reason is None


def test_eos_stops_and_is_kept(setup):
    policy, ids, ref, k = setup
    out = run(policy, ids, eos=[ref[k]], max_new_tokens=MAX)
    assert out.output_ids == ref[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert len(out.output_logprobs) == len(out.output_ids) == len(out.output_versions)


def test_ignore_eos_runs_to_length(setup):
    policy, ids, ref, k = setup
    out = run(policy, ids, eos=[ref[k]], max_new_tokens=MAX, ignore_eos=True)
    assert out.output_ids == ref and out.finish_reason == "length"


def test_min_new_tokens_masks_eos(setup):
    policy, ids, ref, k = setup
    out = run(policy, ids, eos=[ref[k]], max_new_tokens=MAX, min_new_tokens=k + 2)
    assert len(out.output_ids) >= k + 2
    assert ref[k] not in out.output_ids[: k + 1]
    # HF's min_new_tokens does the same masking: the oracle.
    hf = policy.model.generate(torch.tensor([ids]), max_new_tokens=MAX, do_sample=False, min_new_tokens=k + 2,
                               eos_token_id=ref[k], pad_token_id=0)[0, len(ids):].tolist()
    assert out.output_ids == hf


def test_stop_token_ids(setup):
    policy, ids, ref, k = setup
    out = run(policy, ids, max_new_tokens=MAX, stop_token_ids=[ref[k]])
    assert out.output_ids == ref[: k + 1] and out.finish_reason == "stop" and out.stop_reason == ref[k]


def test_stop_strings_truncate_text(setup):
    policy, ids, ref, _ = setup
    tok = policy.tokenizer
    full_text = tok.decode(ref, skip_special_tokens=True)
    # Pick a stop string that starts in the middle of the output.
    first = len(tok.decode(ref[:6], skip_special_tokens=True))
    start = next(i for i in range(first, len(full_text) - 3)
                 if full_text[i:i + 3] not in full_text[:i + 2] and "\ufffd" not in full_text[i:i + 3])
    stop = full_text[start:start + 3]
    out = run(policy, ids, max_new_tokens=MAX, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full_text[: full_text.index(stop)]
    assert out.output_ids == ref[: len(out.output_ids)] and len(out.output_ids) < MAX
    assert stop in tok.decode(out.output_ids, skip_special_tokens=True)


def _family_tokenizer_paths():
    from unsloth_rollout.testing.families import FAMILIES, family_model_path
    from unsloth_rollout.testing.real import real_checkpoint_path
    from unsloth_rollout.testing.tiny import tiny_model_path
    from unsloth_rollout.testing.vlm_families import VLM_FAMILIES, vlm_family_path

    paths = {"qwen2_5_vl": tiny_model_path("qwen2_5_vl"), "smollm2": real_checkpoint_path("smollm2-135m-instruct")}
    paths.update({f: family_model_path(f) for f in FAMILIES})
    paths.update({f: vlm_family_path(f) for f in VLM_FAMILIES})
    return paths


def test_incremental_text_is_the_full_decode_at_every_token():
    """OutputProcessor.text (what stop strings and stream deltas read) decodes new tokens incrementally; at every
    token it must equal tokenizer.decode of the whole output (the oracle), for every served family's tokenizer,
    on random ids (special tokens, split multi-byte characters) and on real text, with and without
    skip_special_tokens. On plain text the whole output is decoded only where a token holds bytes back."""
    import random

    from transformers import AutoTokenizer

    from unsloth_rollout.engine.inputs import PreparedPrompt
    from unsloth_rollout.engine.output import OutputProcessor
    from unsloth_rollout.engine.sequence import Sequence

    texts = ["Hello world, ", "naïve café ", "日本語のテキスト ", "😀 emoji ", "  spaces\n\nnew line"]
    for name, path in _family_tokenizer_paths().items():
        tok = AutoTokenizer.from_pretrained(path)
        proc = OutputProcessor(tok, [], 1 << 20)
        assert proc._backend is not None, name  # every served family's tokenizer streams
        rng = random.Random(0)
        for trial in range(40):
            if trial % 2:
                ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
            else:
                ids = tok.encode(rng.choice(texts) * 3, add_special_tokens=False)
            for skip in (True, False):
                s = Sequence("r", 0, PreparedPrompt([1]), SamplingParams(skip_special_tokens=skip))
                for t in ids:
                    s.output_ids.append(t)
                    assert proc.text(s) == tok.decode(s.output_ids, skip_special_tokens=skip), (name, s.output_ids)
        calls = []
        decode = tok.decode
        tok.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
        s = Sequence("r", 0, PreparedPrompt([1]), SamplingParams())
        for t in tok.encode("Alice and Bob count the red apples at the market. " * 8, add_special_tokens=False):
            s.output_ids.append(t)
            proc.text(s)
        assert len(calls) <= 2, (name, len(calls))
