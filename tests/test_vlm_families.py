"""Every vision-language family the engine accepts beyond Qwen-VL, exact in one mixed batch with images.

Tiny random models from transformers' own config classes (unsloth_rollout.testing.vlm_families), with
the family's own processor (PIL image processor, no torchvision) and LoRA r=8 with non-zero B on the
language AND the vision layers. Per family, one engine run holds 12 greedy chat prompts of mixed
lengths with 0, 1 or 2 images (several longer than the 8-token sliding windows; half arriving while
the other half decodes), a GRPO group of 4 sampled completions sharing one prompt and image, and a KV
budget small enough to force preemption (a preempted sequence is recomputed with its images).
Oracles: HF ``generate()`` one prompt at a time on the processor's own encoding for the greedy tokens,
and a teacher-forced forward over prompt + output with the same pixel inputs for every logprob, held to
``parity_bound`` (1e-5, or 1.5x HF ``generate()``'s own distance from that forward, measured here).
"""

from __future__ import annotations


import pytest
import torch

from unsloth_rollout.testing.oracles import hf_generate_logprobs, parity_bound, perturb_lora, teacher_forced_logprobs
from unsloth_rollout.testing.drive import run_staggered
from unsloth_rollout.testing.toy import random_images
from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.kv_cache import KVCache
from unsloth_rollout.models.families import text_dims
from unsloth_rollout.testing.vlm_families import VLM_FAMILIES, vlm_family_path

WORDS = ("the quick brown fox jumps over a lazy dog while Alice and Bob count 12 + 7 = 19 apples in Paris "
         "and Tokyo before the rain starts").split()
MAX_NEW = 12
N_PROMPTS = 12


def messages(i: int, n_images: int) -> list[dict]:
    text = " ".join((WORDS * 3)[i * 2: i * 2 + 1 + 3 * i])
    parts = [{"type": "image"} for _ in range(n_images)]
    # Text before and after the images for odd prompts: image blocks in the middle of the sequence.
    parts = ([{"type": "text", "text": "look:"}] if i % 2 else []) + parts + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def load_family(family: str):
    torch.manual_seed(0)  # LoRA A init draws from the global RNG
    policy = load_model(str(vlm_family_path(family)), backend="transformers", lora={"r": 8})
    assert perturb_lora(policy.model, std=0.3) > 0
    lora_b = [n for n, _ in policy.model.named_parameters() if "lora_B" in n]
    assert any(".visual." in n or "vision" in n for n in lora_b), f"{family}: no LoRA on the vision tower"
    assert any(".visual." not in n and "vision" not in n for n in lora_b), f"{family}: no LoRA on the language model"
    return policy


def processor_inputs(policy, req) -> dict:
    """The processor's own encoding of the request (what a trainer would feed the model)."""
    text = policy.processor.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False)
    return dict(policy.processor(text=[text], images=[req.images] if req.images else None, return_tensors="pt"))


def hf_greedy(policy, inputs: dict, suppress: list[int]) -> tuple[list[int], torch.Tensor]:
    """HF generate()'s greedy tokens on the processor's encoding and the logprobs of its own cached decode."""
    return hf_generate_logprobs(policy.model, inputs, MAX_NEW, suppress_tokens=suppress or None)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_vlm_family_mixed_batch_exact(family):
    policy = load_family(family)
    images = random_images(2 * N_PROMPTS, seed=3)
    greedy = []
    for i in range(N_PROMPTS):
        k = (0, 1, 2)[i % 3]
        greedy.append(GenerationRequest(messages=messages(i, k), images=images[2 * i: 2 * i + k],
                                        sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=0)))
    group = GenerationRequest(messages=messages(5, 1), images=[images[23]],
                              sampling=SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, n=4, seed=7))
    encodings = [processor_inputs(policy, r) for r in greedy]

    layers, kv_heads, head_dim = text_dims(policy.text_config)
    per_token = KVCache.bytes_per_token(layers, kv_heads, head_dim, torch.float32)
    # Blocks of 8 tokens for about 4 of the 16 sequences at once (and the longest alone): far less than they
    # need together, so some are preempted and recomputed with their images.
    need = [-(-(e["input_ids"].shape[1] + MAX_NEW) // 8) for e in encodings]
    blocks = max(max(need) + 2, 4 * sum(need) // len(need))
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=per_token * 8 * blocks, block_size=8), seed=0)

    outs, stats = run_staggered(engine, greedy[:6], greedy[6:] + [group])
    suppress = engine.core.sampler.suppress_ids
    engine.shutdown()
    assert all(o.error is None for out in outs for o in out), [o.error for out in outs for o in out]
    assert stats["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert stats["prefix_cache_hits"] > 0, "the group's samples should share their prompt's prefill"
    lengths = [len(o[0].prompt_ids) for o in outs[:N_PROMPTS]]
    assert min(lengths) > 8 and len(set(lengths)) >= 10, lengths

    with torch.no_grad():
        mismatches = []
        hf_distance = 0.0
        for req, (out,), inputs in zip(greedy, outs[:N_PROMPTS], encodings):
            assert out.prompt_ids == inputs["input_ids"][0].tolist(), "the engine's prompt differs from the processor's"
            policy.clear_rope_deltas()
            want, hf_lp = hf_greedy(policy, inputs, suppress)
            if out.output_ids != want:
                mismatches.append((len(out.prompt_ids), len(req.images or []), out.output_ids, want))
                continue
            ref, _ = teacher_forced_logprobs(policy, out.prompt_ids, want, mm=inputs)
            hf_distance = max(hf_distance, (hf_lp - ref).abs().max().item())
        assert not mismatches, (f"{family}: {len(mismatches)}/{N_PROMPTS} greedy outputs differ from HF generate: "
                                f"{mismatches[:2]}")
        samples = outs[N_PROMPTS]
        assert len(samples) == 4 and len({tuple(s.output_ids) for s in samples}) > 1
        group_inputs = processor_inputs(policy, group)
        worst = 0.0
        pairs = [(r, o[0], e) for r, o, e in zip(greedy, outs[:N_PROMPTS], encodings)]
        pairs += [(group, s, group_inputs) for s in samples]
        for req, out, enc in pairs:
            temp = req.sampling.temperature or 1.0
            ref, _ = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, temperature=temp, mm=enc)
            got = torch.tensor(out.output_logprobs)
            assert torch.isfinite(got).all()
            worst = max(worst, (got - ref).abs().max().item())
        assert worst <= parity_bound(hf_distance), (f"{family}: logprob drift {worst:.2e} from a teacher-forced "
                                                    f"forward (HF generate()'s own: {hf_distance:.2e})")


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_vlm_family_prompt_forms_agree(family):
    """Chat messages, token ids with one placeholder per image (ArealOpenAI) and ids the processor already
    expanded (AReaL's VisionRLVRWorkflow) give the same prompt, pixels and tokens; a wrong count is refused by
    field."""
    policy = load_model(str(vlm_family_path(family)), backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    imgs = random_images(2, seed=11)
    msgs = messages(3, 2)
    text = policy.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expanded = processor_inputs(policy, GenerationRequest(messages=msgs, images=imgs))["input_ids"][0].tolist()
    placeholder = policy.tokenizer.encode(text, add_special_tokens=False)
    assert len(placeholder) < len(expanded)
    sp = SamplingParams(max_new_tokens=6, temperature=0)
    outs = engine.generate([GenerationRequest(messages=msgs, images=imgs, sampling=sp),
                            GenerationRequest(input_ids=placeholder, images=imgs, sampling=sp),
                            GenerationRequest(input_ids=expanded, images=imgs, sampling=sp),
                            GenerationRequest(input_ids=placeholder, images=imgs[:1], sampling=sp),
                            GenerationRequest(input_ids=placeholder, sampling=sp)])
    engine.shutdown()
    assert all(o.error is None for o in outs[:3]), [o.error for o in outs]
    assert all(o.prompt_ids == expanded for o in outs[:3])
    assert len({tuple(o.output_ids) for o in outs[:3]}) == 1
    assert outs[3].error is not None and "input_ids" in outs[3].error
    assert outs[4].error is not None and "no image" in outs[4].error


def test_mllama_refused_at_load(tmp_path):
    """Llama 3.2 Vision (cross-attention to image features) is refused by name, before any weight loads."""
    from transformers import MllamaConfig

    from unsloth_rollout import UnsupportedModelError

    MllamaConfig().save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'mllama'.*cross-attention.*vision-language: .*gemma3"):
        load_model(str(tmp_path), backend="transformers")
    with pytest.raises(UnsupportedModelError, match="cross-attention"):
        load_model(str(tmp_path), backend="transformers", allow_unverified_family=True)


@pytest.mark.parametrize("family", VLM_FAMILIES)
def test_vlm_fixture_images_and_masks_matter(family):
    """The fixtures make the parity test able to fail: the pixels change the next-token logits, and for Gemma 3
    so does the bidirectional attention inside each image (an engine attending causally there would differ)."""
    policy = load_model(str(vlm_family_path(family)), backend="transformers")
    req = GenerationRequest(messages=messages(1, 1), images=random_images(1, seed=1))  # the image within reach
    inputs = processor_inputs(policy, req)
    other = processor_inputs(policy, GenerationRequest(messages=req.messages, images=[
        random_images(1, seed=2)[0].resize(req.images[0].size)]))
    assert other["input_ids"].tolist() == inputs["input_ids"].tolist()
    with torch.no_grad():
        base = policy.model(**inputs).logits[0, -1]
        assert (policy.model(**other).logits[0, -1] - base).abs().max() > 1e-2
        if "token_type_ids" in inputs:
            causal = {k: v for k, v in inputs.items() if k != "token_type_ids"}
            assert (policy.model(**causal).logits[0, -1] - base).abs().max() > 1e-2
