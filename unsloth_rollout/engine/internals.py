"""The private parts of torch, transformers and PEFT the engine relies on, in one place.

Every name here is a library's private attribute or module, read or written the way the engine needs it; no other
module of ``engine/`` touches one (tests/test_layout.py checks that from the source). Checked against torch 2.13,
transformers 5.17 and PEFT 0.18 (the pinned line) and the newest release the smoke run resolves; where one moves,
this is the one file to change.
"""

from __future__ import annotations

import torch
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle


# ------------------------------------------------------------------ transformers
def configured_attention(config) -> str | None:
    """The attention implementation a transformers config was loaded with (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def swap_attention(config, name: str | None) -> str | None:
    """Set a model's attention implementation to ``name`` (transformers reads ``config._attn_implementation_internal``
    at every attention call); returns the one it replaces, to be put back the same way after the forward. Only
    while the engine holds ``policy.lock``: nothing else runs the model then."""
    saved = config._attn_implementation_internal
    config._attn_implementation_internal = name
    return saved


def tokenizer_backend(tokenizer):
    """A fast tokenizer's ``tokenizers.Tokenizer`` (``tokenizer._tokenizer``), or None."""
    return getattr(tokenizer, "_tokenizer", None)


# ------------------------------------------------------------------ PEFT
# Per LoRA layer (PEFT's BaseTunerLayer), the attributes that choose what its forward computes (read by name from
# each layer's ``__dict__``: engine/weights.py's ``WeightsClock.watch``).
LORA_SWITCHES = ("_disable_adapters", "_active_adapter", "merged_adapters", "scaling")


# ------------------------------------------------------------------ torch: modules and hooks
def global_hooks() -> tuple[dict, dict]:
    """torch's global module forward hooks and pre-hooks (``register_module_forward_hook``): they run on every
    module."""
    return _torch_module._global_forward_hooks, _torch_module._global_forward_pre_hooks


def module_hooks(module: torch.nn.Module) -> tuple[dict, dict]:
    """A module's own forward hooks and pre-hooks."""
    return module._forward_hooks, module._forward_pre_hooks


def hook_dicts(module_dict: dict) -> tuple[dict, dict]:
    """The forward hooks and pre-hooks of the module whose ``__dict__`` is ``module_dict``."""
    return module_dict["_forward_hooks"], module_dict["_forward_pre_hooks"]


def hook_counter() -> int:
    """torch's hook-handle counter: every ``register_*hook`` call takes the next id, so a hook added anywhere moves
    it."""
    return RemovableHandle.next_id


def children(module: torch.nn.Module) -> dict:
    """A module's child modules by name (``module._modules``, the dict ``setattr`` and ``del`` change)."""
    return module._modules


# ------------------------------------------------------------------ torch: compilation
def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tell dynamo this dimension varies (one graph for every size, never a recompile as it grows)."""
    torch._dynamo.mark_dynamic(tensor, dim)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def guards_on_hooks():
    """A context in which dynamo guards on nn.Module hooks (``skip_nnmodule_hook_guards`` is on by default: one
    graph would serve a layer with a hook and one without)."""
    return torch._dynamo.config.patch(skip_nnmodule_hook_guards=False)


def inductor_wrapper():
    """torch.compile's inductor backend class (``torch._TorchCompileInductorWrapper``), or None where this torch has
    none."""
    return getattr(torch, "_TorchCompileInductorWrapper", None)


def boxed_like(run, fn) -> None:
    """Give ``run`` (a wrapper of a compiled graph ``fn``) ``fn``'s calling convention (``_boxed_call``)."""
    run._boxed_call = getattr(fn, "_boxed_call", False)


# ------------------------------------------------------------------ torch: kernels
def cpu_flash_attention(q, k, v, mask, scale):
    """SDPA's CPU flash kernel with its log-sum-exp (what ``scaled_dot_product_attention`` runs on CPU, minus the
    LSE it drops): ``(out, lse)``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                      scale=scale)
