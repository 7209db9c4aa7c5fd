"""EngineConfig: one object, sizing at the top and one nested config per part; the old flat spellings still work,
each with a DeprecationWarning, and land where the new spelling puts them."""

from __future__ import annotations

import dataclasses

import pytest

from unsloth_rollout import EngineConfig, InvalidRequestError
from unsloth_rollout.engine.config import (DEPRECATED_NAMES, DEPRECATED_SETTINGS, DecodeConfig, LoRAConfig,
                                           MultiModalConfig, PrefillConfig)

# Each old spelling, a value for it, and the new spelling's config it must equal.
OLD_AND_NEW = [
    ({"decode_backend": "workspace"}, EngineConfig(decode=DecodeConfig(backend="workspace"))),
    ({"decode_backend": "static"}, EngineConfig(decode=DecodeConfig(backend="compiled"))),
    ({"decode_compile": True}, EngineConfig(decode=DecodeConfig(backend="compiled"))),
    ({"compile_mode": "cuda-graphs"}, EngineConfig(decode=DecodeConfig(backend="graph"))),
    ({"compile_mode": "max-autotune"}, EngineConfig(decode=DecodeConfig(compile_mode="max-autotune"))),
    ({"decode_layers_per_call": 2}, EngineConfig(decode=DecodeConfig(layers_per_call=2))),
    ({"shared_prefix_decode": False}, EngineConfig(decode=DecodeConfig(shared_prompt=False))),
    ({"shared_prefix_min_tokens": 64}, EngineConfig(decode=DecodeConfig(shared_prompt_min_tokens=64))),
    ({"cpu_attention_kernel": False}, EngineConfig(decode=DecodeConfig(cpu_kernel=False))),
    ({"decode_workspace_bytes": 0}, EngineConfig(decode=DecodeConfig(workspace_bytes=0))),
    ({"max_prefill_tokens": 256}, EngineConfig(prefill=PrefillConfig(max_tokens=256))),
    ({"prefill_chunk_tokens": 64}, EngineConfig(prefill=PrefillConfig(chunk_tokens=64))),
    ({"max_lora_rank": 8, "max_loras": 2}, EngineConfig(lora=LoRAConfig(max_lora_rank=8, max_loras=2))),
    ({"mm_processor_cache_bytes": 0}, EngineConfig(multimodal=MultiModalConfig(mm_processor_cache_bytes=0))),
    ({"suppress_vision_tokens": False}, EngineConfig(multimodal=MultiModalConfig(suppress_vision_tokens=False))),
    # two old names of one part, beside a new spelling of it: all three land in the one nested config
    ({"decode_backend": "workspace", "cpu_attention_kernel": False, "decode": DecodeConfig(layers_per_call=1)},
     EngineConfig(decode=DecodeConfig(backend="workspace", cpu_kernel=False, layers_per_call=1))),
]


def test_every_old_spelling_is_covered_here():
    assert {k for old, _ in OLD_AND_NEW for k in old if k in DEPRECATED_SETTINGS} == set(DEPRECATED_SETTINGS)


@pytest.mark.parametrize("old,new", OLD_AND_NEW, ids=lambda x: ",".join(x) if isinstance(x, dict) else "")
def test_an_old_spelling_warns_and_means_the_new_one(old, new):
    with pytest.warns(DeprecationWarning, match="deprecated"):
        config = EngineConfig(**old)
    assert config == new


def test_old_names_read_the_nested_values_with_a_warning():
    config = EngineConfig(decode=DecodeConfig(backend="workspace"), lora=LoRAConfig(max_lora_rank=8))
    for old, (part, field) in DEPRECATED_NAMES.items():
        with pytest.warns(DeprecationWarning, match=f"EngineConfig.{old} is deprecated"):
            assert getattr(config, old) == getattr(getattr(config, part), field)
    with pytest.raises(AttributeError):
        config.no_such_setting  # noqa: B018


def test_the_new_spellings_warn_nothing(recwarn):
    EngineConfig(kv_cache_memory_bytes=1 << 20, decode=DecodeConfig(backend="compiled", layers_per_call=2),
                 prefill=PrefillConfig(chunk_tokens=64), lora=LoRAConfig(max_loras=2),
                 multimodal=MultiModalConfig(mm_processor_cache_bytes=0))
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_one_object_with_at_most_twelve_settings_at_the_top():
    top = [f.name for f in dataclasses.fields(EngineConfig)]
    assert len(top) <= 12, top
    assert {"decode", "prefill", "lora", "multimodal"} <= set(top)


def test_nested_configs_from_dicts_as_yaml_gives_them():
    config = EngineConfig(decode={"backend": "workspace"}, lora={"max_loras": 3})
    assert config.decode == DecodeConfig(backend="workspace") and config.lora == LoRAConfig(max_loras=3)
    with pytest.raises(InvalidRequestError, match="decode must be a DecodeConfig"):
        EngineConfig(decode="compiled")


@pytest.mark.parametrize("bad,field", [
    (dict(backend="fast"), "decode.backend"), (dict(layers_per_call=0), "decode.layers_per_call"),
    (dict(workspace_bytes=-1), "decode.workspace_bytes"), (dict(cpu_kernel="yes"), "decode.cpu_kernel"),
    (dict(shared_prompt=1), "decode.shared_prompt"), (dict(shared_prompt_min_tokens=0),
                                                       "decode.shared_prompt_min_tokens")])
def test_a_bad_decode_setting_is_refused_by_its_name(bad, field):
    with pytest.raises(InvalidRequestError, match=field) as e:
        DecodeConfig(**bad)
    assert e.value.field == field


def test_an_unknown_setting_is_still_refused():
    with pytest.raises(TypeError):
        EngineConfig(decode_fast=True)
