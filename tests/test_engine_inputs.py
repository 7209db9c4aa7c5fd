"""Request inputs: every image form, expanded or placeholder token ids, chat messages; bad input fails
alone with an error naming the field while the other requests complete."""

from __future__ import annotations

import base64
import io

import pytest

from unsloth_rollout.testing.toy import random_images
from unsloth_rollout import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from unsloth_rollout import load_model


@pytest.fixture(scope="module")
def vlm(qwen2_5_vl_dir):
    policy = load_model(qwen2_5_vl_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    yield policy, engine
    engine.shutdown()


def png_bytes(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_image_forms_and_id_forms_agree(vlm, tmp_path):
    policy, engine = vlm
    img = random_images(1, seed=5)[0]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    text = policy.processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    expanded = policy.processor(text=[text], images=[img], return_tensors="pt")["input_ids"][0].tolist()
    placeholder = policy.tokenizer.encode(text)
    assert len(placeholder) < len(expanded)
    path = tmp_path / "img.png"
    path.write_bytes(png_bytes(img))
    b64 = base64.b64encode(png_bytes(img)).decode()
    sp = SamplingParams(max_new_tokens=6, temperature=0)
    reqs = [
        GenerationRequest(input_ids=expanded, images=[img], sampling=sp),  # VisionRLVRWorkflow style
        GenerationRequest(input_ids=placeholder, images=[b64], sampling=sp),  # ArealOpenAI style
        GenerationRequest(messages=msgs, images=[str(path)], sampling=sp),
        GenerationRequest(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
            {"type": "text", "text": "what is it?"}]}], sampling=sp),
        GenerationRequest(input_ids=expanded, images=[png_bytes(img)], sampling=sp),
    ]
    outs = engine.generate(reqs)
    assert all(o.error is None for o in outs)
    assert all(o.prompt_ids == expanded for o in outs)
    assert len({tuple(o.output_ids) for o in outs}) == 1


def test_bad_requests_fail_alone(vlm):
    policy, engine = vlm
    good = GenerationRequest(messages=[{"role": "user", "content": "hi"}],
                             sampling=SamplingParams(max_new_tokens=4, temperature=0))
    corrupt = GenerationRequest(messages=[{"role": "user", "content": [{"type": "image"}]}],
                                images=[b"\x89PNG\r\n\x1a\n not really"], sampling=SamplingParams(max_new_tokens=4))
    bad_b64 = GenerationRequest(messages=[{"role": "user", "content": [{"type": "image"}]}],
                                images=["%%%not-base64%%%"], sampling=SamplingParams(max_new_tokens=4))
    wrong_count = GenerationRequest(input_ids=policy.tokenizer.encode("<|image_pad|><|image_pad|><|image_pad|>"),
                                    images=random_images(1), sampling=SamplingParams(max_new_tokens=4))
    out_of_vocab = GenerationRequest(input_ids=[1, 2, 10**7], sampling=SamplingParams(max_new_tokens=4))
    outs = engine.generate([good, corrupt, bad_b64, wrong_count, out_of_vocab, good.__class__(
        messages=good.messages, sampling=good.sampling)])
    assert outs[0].error is None and outs[5].error is None and outs[0].output_ids == outs[5].output_ids
    assert "cannot decode image" in outs[1].error
    assert "base64" in outs[2].error
    assert "image tokens" in outs[3].error
    assert "outside" in outs[4].error
    for field, req in [("images[0]", corrupt), ("input_ids", out_of_vocab)]:
        with pytest.raises(InvalidRequestError) as e:
            engine.submit(req)
        assert e.value.field == field
    assert engine.stats()["num_running"] == 0


def test_text_model_rejects_images(qwen2_dir):
    engine = RolloutEngine(load_model(qwen2_dir, backend="transformers"), EngineConfig(kv_cache_memory_bytes=1 << 20))
    with pytest.raises(InvalidRequestError, match="takes no images"):
        engine.submit(GenerationRequest(input_ids=[1, 2, 3], images=random_images(1)))
    engine.shutdown()
