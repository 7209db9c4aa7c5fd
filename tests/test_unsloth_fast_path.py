"""Unsloth's text fast path on CUDA, held to its contract on CPU: refused by name at engine construction.

``FastLanguageModel`` on CUDA replaces the llama-style decoder's forward (unsloth/models/llama.py,
``LlamaModel_fast_forward``, unsloth 2026.10.9): it reads ``past_key_values[0][0]`` (a legacy per-layer tuple)
and runs its layers on KV buffers of its own. The test double below does both to a tiny Llama's decoder; the
engine must refuse it with ``CacheBypassError`` naming the remedy (``backend='transformers'``), not a TypeError,
and ``load_model(backend="auto")`` must not pick that path on CUDA.
"""

from __future__ import annotations

import types

import pytest
import torch
from transformers import DynamicCache

from unsloth_rollout import CacheBypassError, EngineConfig, RolloutEngine, load_model
from unsloth_rollout.models import loader
from unsloth_rollout.testing.families import family_model_path


def _unsloth_like(decoder, index_cache: bool = True):
    """Patch ``decoder.forward`` as Unsloth's fast path behaves: index the cache it is handed like a legacy
    tuple, then run the layers on a private DynamicCache."""
    original = decoder.forward

    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        if past_key_values is not None and index_cache:
            past_key_values[0][0].shape[-2]  # noqa: B018  (LlamaModel_fast_forward's first read of the cache)
        kwargs.pop("use_cache", None)
        return original(input_ids=input_ids, past_key_values=DynamicCache(config=self.config), use_cache=True,
                        **kwargs)

    decoder.forward = types.MethodType(forward, decoder)


@pytest.fixture
def llama():
    return load_model(str(family_model_path("llama")), backend="transformers")


def test_the_double_is_a_working_forward(llama):
    """Oracle: without a cache from the engine, the patched decoder computes the model's own logits."""
    ids = torch.tensor([llama.tokenizer.encode("the quick brown fox")])
    with torch.no_grad():
        want = llama.model(input_ids=ids).logits
        _unsloth_like(llama.base_model.model)
        got = llama.model(input_ids=ids).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("index_cache", [True, False], ids=["indexes-the-cache", "private-cache-only"])
def test_unsloth_fast_path_is_refused_with_the_remedy(llama, index_cache):
    _unsloth_like(llama.base_model.model, index_cache)
    with pytest.raises(CacheBypassError, match="backend='transformers'") as err:
        RolloutEngine(llama, EngineConfig(kv_cache_memory_bytes=4 << 20))
    if index_cache:
        assert "legacy tuple" in str(err.value) and "Unsloth" in str(err.value)


def test_auto_backend_avoids_the_fast_path_on_cuda(monkeypatch):
    monkeypatch.setattr(loader, "_unsloth_importable", lambda: True)
    monkeypatch.setattr(loader, "_cuda", lambda: True)
    for model_type in sorted(loader.UNSLOTH_FAST_PATH_TYPES):
        chosen, reason = loader.resolve_backend("auto", False, model_type)
        assert chosen == "transformers" and "KV cache" in reason, (model_type, reason)
        assert loader.resolve_backend("unsloth", False, model_type)[0] == "unsloth"  # asked for: loaded
    assert loader.resolve_backend("auto", False, "phi3")[0] == "unsloth"  # Unsloth's FastModel path
    assert loader.resolve_backend("auto", True, "qwen2_5_vl")[0] == "unsloth"  # FastVisionModel
    monkeypatch.setattr(loader, "_cuda", lambda: False)
    assert loader.resolve_backend("auto", False, "qwen2")[0] == "unsloth"  # the CPU backend patches nothing
