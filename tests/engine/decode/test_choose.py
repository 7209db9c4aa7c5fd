"""Which decode step runs (engine/decode/choose.py): the engine's ``auto`` and each step's choice.

The tables are pure functions of what they look at, so they are held to the cases the engine's measurements and
refusals name (benchmarks/gpu/README.md, the compiled step's own limits); the engines built in the other decode
tests hold every variant to HF ``generate()`` and a teacher-forced forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from unsloth_rollout.engine.decode.choose import (BACKENDS, COMPILED_MIN_SHARED, EAGER_MIN_SHARED, DecodeFacts,
                                                  check_bitwise, choose_backend, choose_step, facts_of,
                                                  layers_per_call, shared_prompt_min_tokens)
from unsloth_rollout.errors import BitwiseModeError


def test_auto_runs_the_compiled_step_on_cuda_only_where_it_was_measured():
    """decode backend "auto" on CUDA: the compiled step for transformers + PEFT in full or half precision (measured
    on an H200, benchmarks/gpu/README.md); the eager workspace for 4-bit weights and Unsloth-loaded models."""

    def auto_decode_backend(device, workspace_bytes, policy):
        return choose_backend(facts_of(policy, device, workspace_bytes))[0]

    class Linear4bit(torch.nn.Linear):  # what bitsandbytes' quantized layers are called
        pass

    cuda = torch.device("cuda")
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    quantized = torch.nn.Sequential(Linear4bit(2, 2))
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="transformers", model=plain)) == "compiled"
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="transformers", model=quantized)) == "workspace"
    assert auto_decode_backend(cuda, None, SimpleNamespace(backend="unsloth", model=plain)) == "workspace"
    assert auto_decode_backend(cuda, 0, SimpleNamespace(backend="transformers", model=plain)) == "workspace"
    assert auto_decode_backend(torch.device("mps"), None, SimpleNamespace(backend="transformers", model=plain)) \
        == "workspace"
    fp64 = SimpleNamespace(backend="transformers", model=plain, dtype=torch.float64)
    assert auto_decode_backend(cuda, None, fp64) == "workspace"


def test_auto_on_a_cpu_compiles_where_inductor_finds_a_compiler(monkeypatch):
    from unsloth_rollout.engine.decode import choose

    policy = SimpleNamespace(backend="transformers", model=torch.nn.Linear(2, 2))
    for found, want in ((True, "compiled"), (False, "workspace")):
        monkeypatch.setattr(choose, "cxx_compiler", lambda: found)
        variant, why = choose_backend(facts_of(policy, torch.device("cpu"), None))
        assert variant == want and "compiler" in why


STEP = dict(arranged=True, compiled=True, eager=False, adapters=False, shared=False, compiled_reads_shared=False,
            fits=lambda: True)


@pytest.mark.parametrize("change,want", [
    ({}, "compiled"),
    ({"arranged": False}, "gather"),  # no workspace, or its rows over its budget this step
    ({"compiled": False}, "workspace"),  # the eager variant
    ({"eager": True}, "workspace"),  # the probe's step
    ({"adapters": True}, "workspace"),  # rows naming adapters
    ({"shared": True}, "workspace"),  # shared prompts the graph does not read (no CPU kernel)
    ({"shared": True, "compiled_reads_shared": True}, "compiled"),
    ({"fits": lambda: False}, "workspace"),  # the padded batch over the budget
    ({"paged": True}, "paged"),  # the paged step (configured): every step, whatever its rows
    ({"paged": True, "arranged": False, "eager": True, "adapters": True}, "paged"),
])
def test_each_step_runs_the_variant_its_rows_allow(change, want):
    assert choose_step(**{**STEP, **change}) == want


def test_a_step_that_cannot_run_compiled_never_asks_the_workspace_to_grow():
    """``fits`` may grow the workspace: it is asked only when every other row let the compiled step run."""
    asked = []
    choose_step(**{**STEP, "adapters": True, "fits": lambda: asked.append(1) or True})
    assert not asked


def test_the_defaults_taken_from_the_model():
    assert layers_per_call(None, True) == 4 and layers_per_call(None, False) == 1 and layers_per_call(2, True) == 2
    assert shared_prompt_min_tokens(None, "compiled", kernel=False) == COMPILED_MIN_SHARED == 640
    assert shared_prompt_min_tokens(None, "compiled", kernel=True) == EAGER_MIN_SHARED == 32
    assert shared_prompt_min_tokens(None, "workspace", kernel=False) == 32
    assert shared_prompt_min_tokens(100, "compiled", kernel=False) == 100


def test_auto_never_picks_the_paged_step_and_the_bitwise_mode_refuses_it():
    """The paged step (attention through the Triton kernel) is configured only: no row of ``auto``'s table names it,
    whatever the device; the bitwise on-policy mode refuses it by name (its kernel sums keys in its own order)."""
    assert "paged" in BACKENDS
    for device in ("cuda", "cpu", "mps"):
        for loader, quantized, compiler, ws in (("transformers", False, True, None), ("unsloth", True, False, 0)):
            facts = DecodeFacts(device, torch.bfloat16, loader, quantized, compiler, ws)
            assert choose_backend(facts)[0] != "paged"
    with pytest.raises(BitwiseModeError, match="decode.backend='paged'"):
        check_bitwise("paged", None)
