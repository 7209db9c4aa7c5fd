"""Exact or refused: models the engine cannot serve exactly get a named error, never tokens.

- A decoder whose attention skips the engine's KV cache (a test double of Unsloth's CUDA fast path,
  which reads ``past_key_values`` its own way) is refused when the engine is built, and a model that
  starts bypassing later fails every request in flight with the named error; no output comes back.
- A family outside the verified list is refused at load, naming what is supported.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig

from unsloth_rollout import (CacheBypassError, EngineConfig, GenerationRequest, RolloutEngine, SamplingParams,
                             UnsupportedModelError, load_model)
from unsloth_rollout.models.families import check_supported
from unsloth_rollout.testing.families import family_model_path


def _bypass_cache(attn_module):
    """Make one attention layer run without the cache it is handed (as a patched fast path would)."""
    original = attn_module.forward

    def forward(self, *args, **kwargs):
        kwargs["past_key_values"] = None
        return original(*args, **kwargs)

    attn_module.forward = types.MethodType(forward, attn_module)


def _layers(policy):
    return policy.base_model.model.layers


def test_cache_bypass_refused_when_engine_is_built():
    policy = load_model(str(family_model_path("llama")), backend="transformers")
    _bypass_cache(_layers(policy)[1].self_attn)
    with pytest.raises(CacheBypassError, match="LlamaForCausalLM|LlamaAttention"):
        RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20))


def test_cache_bypass_after_start_fails_requests_with_no_output():
    policy = load_model(str(family_model_path("mistral")), backend="transformers")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20))
    ids = policy.tokenizer.encode("the quick brown fox jumps over")
    ok = engine.generate(GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=4, temperature=0)))
    assert len(ok[0].output_ids) == 4 and ok[0].error is None
    # Only the one-token decode path bypasses, as Unsloth's CausalLM_fast_forward does on CUDA.
    attn = _layers(policy)[2].self_attn
    original = attn.forward

    def decode_bypass(self, hidden_states, *args, **kwargs):
        if hidden_states.shape[1] == 1:
            kwargs["past_key_values"] = None
        return original(hidden_states, *args, **kwargs)

    attn.forward = types.MethodType(decode_bypass, attn)
    fut = engine.submit(GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=8, temperature=0)))
    with pytest.raises(CacheBypassError, match="did not"):
        fut.result(timeout=60)
    with pytest.raises(CacheBypassError):  # and the engine keeps refusing rather than serve wrong tokens
        engine.submit(GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=2)))
    engine.shutdown()


def test_unverified_family_refused_at_load(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from unsloth_rollout.testing.tiny import _build_tokenizer

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=800)).save_pretrained(tmp_path)
    _build_tokenizer(746).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*Supported families: text: gemma2, .*llama"):
        load_model(str(tmp_path), backend="transformers")
    # An explicit opt-in loads it; the engine's own refusal still names the family the same way.
    policy = load_model(str(tmp_path), backend="transformers", allow_unverified_family=True)
    policy.allow_unverified_family = False
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=1 << 20))


def test_known_unservable_families_name_the_reason():
    cfg = types.SimpleNamespace(model_type="mllama")
    with pytest.raises(UnsupportedModelError, match="cross-attention"):
        check_supported(cfg)
    with pytest.raises(UnsupportedModelError, match="cross-attention"):
        check_supported(cfg, allow_unverified=True)  # no opt-in for what is known to be wrong


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_every_family_config_is_accepted(family):
    assert check_supported(AutoConfig.from_pretrained(family_model_path(family))) == family


def test_gemma2_fixture_softcap_matters():
    """Soft-capping matters in the fixture (else the Gemma 2 parity test would prove nothing about it)."""
    path = str(family_model_path("gemma2"))
    eager = load_model(path, backend="transformers", attn_implementation="eager")
    ids = torch.tensor([eager.tokenizer.encode("the quick brown fox jumps over a lazy dog while Alice")])
    with torch.no_grad():
        a = eager.model(input_ids=ids).logits
        for m in eager.model.modules():
            if hasattr(m, "attn_logit_softcapping"):
                m.attn_logit_softcapping = None
        b = eager.model(input_ids=ids).logits
    assert (a - b).abs().max() > 1e-2


def test_a_family_whose_model_disagrees_with_its_spec_is_refused(monkeypatch):
    """A listed family whose model lacks the M-RoPE its spec promises (or has what it denies) is refused by name
    when the runner is built, never served with 1-D positions. (Every served VLM's engine build in
    tests/test_vlm_families.py passes the same check with the registry's own spec.)"""
    import dataclasses

    from unsloth_rollout.engine import vision
    from unsloth_rollout.models.families import FAMILIES
    from unsloth_rollout.testing.families import family_path

    policy = load_model(family_path("qwen2_5_vl"), backend="transformers")
    assert vision.PromptVision(policy, policy.device).mrope  # the registry's spec and the model agree
    monkeypatch.setattr(vision, "family_of", lambda cfg: dataclasses.replace(FAMILIES["qwen2_5_vl"], mrope=False))
    with pytest.raises(UnsupportedModelError, match="M-RoPE"):
        vision.PromptVision(policy, policy.device)


def test_every_served_family_is_in_the_readme_table():
    """The README's family table lists exactly the registry's served families (by model_type)."""
    import pathlib
    import re

    from unsloth_rollout.models.families import served_families

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("## Supported model families", 1)[1].split("\n\n## ", 1)[0]
    listed = set(re.findall(r"^\| [^|]*\(`([a-z0-9_]+)`\) \| (?:text|VLM) \|", table, flags=re.M))
    assert listed == set(served_families())
