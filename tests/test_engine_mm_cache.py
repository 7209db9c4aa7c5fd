"""The image-processor cache (engine/mm_cache.py): a repeated image is processed once, and what a hit returns
is what the family's own processor returns for that request (the oracle: the processor called directly);
an image that differs in one pixel misses; a group submitted as separate requests samples the same tokens and
logprobs with the cache as without it; the byte bound holds."""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from unsloth_rollout.engine.config import MultiModalConfig
from unsloth_rollout import load_model
from unsloth_rollout.engine.inputs import PATH_MAX_CHARS
from unsloth_rollout.engine.mm_cache import ProcessorCache
from unsloth_rollout.testing.toy import random_images
from unsloth_rollout.testing.vlm_families import VLM_FAMILIES, vlm_family_path

MSGS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in it?"}]}]


def _oracle(policy, images: list, grid: bool) -> dict:
    """The processor's own outputs for the request, called directly (no engine, no cache)."""
    if grid:  # Qwen-VL: the engine expands the placeholders from image_grid_thw; the image processor makes pixels
        return dict(policy.processor.image_processor(images=images, return_tensors="pt"))
    text = policy.processor.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=False)
    return dict(policy.processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False))


def _assert_same(prepared, enc: dict):
    assert torch.equal(prepared.pixel_values, enc["pixel_values"])
    for k, v in prepared.extra.items():
        assert torch.equal(v, enc[k]) if isinstance(v, torch.Tensor) else v == enc[k], k


@pytest.mark.parametrize("family", ("qwen2_5_vl",) + VLM_FAMILIES)
def test_a_repeated_image_is_processed_once_and_a_hit_is_the_processors_output(family, qwen2_5_vl_dir):
    path = qwen2_5_vl_dir if family == "qwen2_5_vl" else str(vlm_family_path(family))
    policy = load_model(path, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    inputs = engine.core.inputs
    img = random_images(1, seed=3)[0]
    req = GenerationRequest(messages=MSGS, images=[img])
    first = engine.prepare(req)
    misses = inputs.cache.misses
    assert misses >= 1 and inputs.cache.hits == 0
    again = engine.prepare(GenerationRequest(messages=MSGS, images=[img.copy()]))  # same pixels, new object
    assert inputs.cache.misses == misses and inputs.cache.hits >= 1
    assert again.prompt_ids == first.prompt_ids and again.image_hashes == first.image_hashes
    oracle = _oracle(policy, [img], inputs.grid)
    _assert_same(first, oracle)
    _assert_same(again, oracle)
    if inputs.grid:
        assert torch.equal(again.image_grid_thw, oracle["image_grid_thw"])

    # The same image object with one pixel changed is a different image: a miss, and the processor's output
    # for it (a resize may leave the pixels' values as they were; the key is the image, never the result).
    img.putpixel((0, 0), tuple(255 - c for c in img.getpixel((0, 0))))
    changed = engine.prepare(GenerationRequest(messages=MSGS, images=[img]))
    assert inputs.cache.misses == misses + 1
    assert changed.image_hashes != first.image_hashes
    _assert_same(changed, _oracle(policy, [img], inputs.grid))
    # Another image of the same size: a miss with its own pixels.
    img.paste(random_images(1, seed=4)[0].resize(img.size))
    other = engine.prepare(GenerationRequest(messages=MSGS, images=[img]))
    assert inputs.cache.misses == misses + 2 and not torch.equal(other.pixel_values, first.pixel_values)
    _assert_same(other, _oracle(policy, [img], inputs.grid))
    assert engine.stats()["mm_processor_cache_hits"] == inputs.cache.hits
    engine.shutdown()


def test_a_group_of_separate_requests_samples_the_same_with_and_without_the_cache(qwen2_5_vl_dir):
    """AReaL submits a GRPO group's samples one request each: with the cache the image processor runs once per
    group, and every sample's tokens and logprobs are the ones the engine samples without it."""
    policy = load_model(qwen2_5_vl_dir, backend="transformers")
    imgs = random_images(2, seed=8)
    reqs = [GenerationRequest(messages=MSGS, images=[imgs[i // 3]], request_id=f"r{i}",
                              sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=i))
            for i in range(6)]
    runs = {}
    for cache_bytes in (0, 64 << 20):
        engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20,
                                                    multimodal=MultiModalConfig(mm_processor_cache_bytes=cache_bytes)), seed=0)
        outs = engine.generate(reqs)
        st = engine.stats()
        engine.shutdown()
        assert all(o.error is None for o in outs), [o.error for o in outs]
        runs[cache_bytes] = [(o.output_ids, o.output_logprobs) for o in outs]
        if cache_bytes:
            assert (st["mm_processor_cache_misses"], st["mm_processor_cache_hits"]) == (2, 4)
            assert st["mm_processor_cache_bytes"] > 0
        else:
            assert (st["mm_processor_cache_misses"], st["mm_processor_cache_hits"]) == (0, 0)
    assert runs[0] == runs[64 << 20]


def _enc(n_floats: int, fill: float = 0.0) -> dict:
    return {"pixel_values": torch.full((n_floats,), fill), "image_sizes": [[1, 1]]}


def test_the_cache_keeps_within_its_bytes_least_recently_used_out_first():
    cache = ProcessorCache(max_bytes=3 * 400)  # three entries of 100 floats
    made = []

    def make(k):
        made.append(k)
        return _enc(100, float(k))

    for k in (1, 2, 3):
        cache.get((k,), lambda k=k: make(k))
    assert cache.get((1,), lambda: make(1))["pixel_values"][0] == 1  # a hit; 1 is now the most recent
    cache.get((4,), lambda: make(4))  # evicts 2, the least recently used
    assert made == [1, 2, 3, 4] and cache.bytes == 1200 and len(cache) == 3
    cache.get((2,), lambda: make(2))
    assert made[-1] == 2 and (cache.hits, cache.misses) == (1, 5)
    cache.get((9,), lambda: _enc(1000))  # larger than the whole budget: returned, not kept
    assert len(cache) == 3 and cache.bytes <= cache.max_bytes

    def fail():
        raise InvalidRequestError("images", "images: the processor failed")

    with pytest.raises(InvalidRequestError):
        cache.get((5,), fail)
    assert (5,) not in cache._entries  # a failure is not cached: the next request runs the processor again

    off = ProcessorCache(0)
    off.get((1,), lambda: make(7))
    off.get((1,), lambda: make(8))
    assert made[-2:] == [7, 8] and len(off) == 0 and off.hits == 0


def test_the_cache_size_is_validated_by_name():
    with pytest.raises(InvalidRequestError, match="mm_processor_cache_bytes"):
        EngineConfig(multimodal=MultiModalConfig(mm_processor_cache_bytes=-1))


def test_encoded_images_are_decoded_once_and_file_paths_are_read_every_time(qwen2_5_vl_dir, tmp_path):
    """AReaL sends a group's image as the same base64 string n times: decoded once (keyed by its bytes), the
    prompt is the one the decoded PIL image gives. A file path is read again at every request: its file may
    have changed."""
    import base64
    import io

    policy = load_model(qwen2_5_vl_dir, backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    cache = engine.core.inputs.cache
    img = random_images(1, seed=6)[0].resize((120, 96))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    png = buf.getvalue()
    b64 = base64.b64encode(png).decode()
    assert len(b64) >= PATH_MAX_CHARS  # never taken for a path
    ref = engine.prepare(GenerationRequest(messages=MSGS, images=[img]))  # processor output cached
    for form in (b64, "data:image/png;base64," + b64, png):
        misses = cache.misses
        first = engine.prepare(GenerationRequest(messages=MSGS, images=[form]))
        assert cache.misses == misses + 1  # the decode; the processor output is the PIL image's
        again = engine.prepare(GenerationRequest(messages=MSGS, images=[form]))
        assert cache.misses == misses + 1
        for p in (first, again):
            assert p.image_hashes == ref.image_hashes and p.prompt_ids == ref.prompt_ids
            assert torch.equal(p.pixel_values, ref.pixel_values)

    path = tmp_path / "img.png"
    path.write_bytes(png)
    a = engine.prepare(GenerationRequest(messages=MSGS, images=[str(path)]))
    other = random_images(1, seed=7)[0].resize((120, 96))
    other.save(path, format="PNG")
    b = engine.prepare(GenerationRequest(messages=MSGS, images=[str(path)]))
    assert a.image_hashes == ref.image_hashes and b.image_hashes != a.image_hashes
    bad = base64.b64encode(b"not an image" * 400).decode()
    for _ in range(2):  # a failed decode is not cached: the second request fails the same way
        with pytest.raises(InvalidRequestError, match="images"):
            engine.prepare(GenerationRequest(messages=MSGS, images=[bad]))
    engine.shutdown()
