"""Decoder layers in units: one compiled call runs several consecutive layers (decode/compiled.py).

A compiled region's call costs ~80 us on CPU beyond its kernels (dynamo's frame and cache lookup, the AOT
wrapper), ~3 ms of a 36-layer step. A unit of ``size`` consecutive decoder layers of one kind (class, sliding
window, attention type) runs as one call of ``units_call``: the model's own loop still calls every layer, the
unit's first layer (its leader) runs the whole unit, and the others (followers) return what they are given.
One graph serves every unit of a size, as one served every layer (parameters are graph inputs).

That is exact only when the model's loop passes each layer the previous layer's output and the same other
arguments, unchanged, and a layer returns a tensor. So:
- units are formed by default only for the families the registry serves (models/families.py; their transformers
  loops are plain: layer after layer, every layer given the same mask, positions, rotary and cache; the family
  matrix runs them in units against HF generate and a teacher-forced forward, as does
  tests/engine/decode/test_units.py), and only while no decoder layer, and no global module hook, has a hook;
- every follower checks, each step, that its hidden states are the object its leader returned and that its other
  arguments are the objects the leader was given; where not, ``Ungrouped`` is raised, the engine drops units for
  good and runs the step again layer by layer (each layer then rewrites the same K/V positions). A hook raises
  ``Hooked`` before the step: layer by layer while a hook is left, units again (their graphs kept) once none is.
"""

from __future__ import annotations

import torch

from .. import internals

class Ungrouped(RuntimeError):
    """A follower layer was not given its leader's output and arguments: the step runs again layer by layer, and
    so do all later steps."""


class Hooked(Ungrouped):
    """A decoder layer, or every module, has a forward hook: the step runs again layer by layer, and so do later
    steps until no such hook is left (then units again, on the graphs they had)."""


def units_call(layers, caches, hidden_states, *args, **kwargs):
    """What the compiled region runs: ``layers`` in order, each with its own cache kwargs (``caches``)."""
    for layer, cache in zip(layers, caches):
        kwargs.update(cache)
        hidden_states = type(layer).forward(layer, hidden_states, *args, **kwargs)
    return hidden_states


def decoder_layers(model, num_layers: int) -> list:
    """The text decoder's layers: the ModuleList of ``num_layers`` modules with a ``self_attn`` that has a
    ``layer_idx`` (a vision tower's blocks have no layer_idx)."""
    for mod in model.modules():
        if (isinstance(mod, torch.nn.ModuleList) and len(mod) == num_layers
                and all(getattr(getattr(m, "self_attn", None), "layer_idx", None) is not None for m in mod)):
            return list(mod)
    raise RuntimeError(f"compiled decode: no list of {num_layers} decoder layers found in {type(model).__name__}")


def _kind(layer) -> tuple:
    attn = getattr(layer, "self_attn", None)
    return type(layer), getattr(attn, "sliding_window", None), getattr(layer, "attention_type", None)


def plan_units(layers: list, size: int) -> list[list[int]]:
    """Consecutive layers of one kind in units of at most ``size`` (layer indices)."""
    units: list[list[int]] = []
    for i, layer in enumerate(layers):
        if units and len(units[-1]) < size and _kind(layers[units[-1][-1]]) == _kind(layer):
            units[-1].append(i)
        else:
            units.append([i])
    return units


def layer_hooked(layers: list) -> bool:
    """A decoder layer (the module itself) has a forward hook or pre-hook, or a global one exists (it runs on every
    module): such a hook must see each layer's own input and output."""
    hooks, pre_hooks = internals.global_hooks()
    return bool(hooks or pre_hooks or any(h for layer in layers for h in internals.module_hooks(layer)))


class Lead:
    """What a unit's leader was given and returned this step; followers compare theirs with it."""

    __slots__ = ("out", "args", "kwargs")

    def __init__(self):
        self.out, self.args, self.kwargs = None, (), {}

    def follow(self, hidden_states, args, kwargs):
        """A follower's call: its input must be the leader's output, its other arguments the leader's."""
        if (hidden_states is not self.out or not isinstance(self.out, torch.Tensor) or len(args) != len(self.args)
                or any(a is not b for a, b in zip(args, self.args)) or kwargs.keys() != self.kwargs.keys()
                or any(v is not self.kwargs[k] for k, v in kwargs.items())):
            raise Ungrouped("a decoder layer was not given the previous layer's output and the same arguments")
        return hidden_states
