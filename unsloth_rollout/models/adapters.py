"""LoRA adapters served by name beside the policy's own: loaded with vLLM's refusals, selected per forward,
and every PEFT setting a forward or a load changes put back, so the shared model is never left different.

Which adapter a forward runs is set here, not with ``PeftModel.forward(adapter_names=...)``: PEFT sends those
names into every LoRA layer, the vision tower's too (whose first dimension counts patches, not rows), and removes
its hooks only when the forward returns, so one exception left them on the model the trainer also uses.

PEFT internals read and written (checked against peft 0.18.1; nothing else in the package touches them):

- ``_active_adapter`` / ``_disable_adapters`` of ``BaseTunerLayer`` and ``AuxiliaryTrainingWrapper``: the per-layer
  switch ``set_adapter`` writes, written directly because ``set_adapter`` also rewrites ``requires_grad``;
- the ``adapter_names`` keyword of a layer's forward (PEFT's mixed batch), injected by our own pre-hooks;
- ``add_adapter`` + ``set_peft_model_state_dict`` to load, ``delete_adapter`` / ``unload`` to drop: they also
  touch ``requires_grad`` and ``training`` of the trainer's parameters, which ``_preserved`` restores.

Example::

    load_adapter(policy, "a1", "/ckpt/a1", max_rank=64)     # refused with InvalidRequestError naming why
    with adapter_scope(policy.model, ["a1", "__base__"]):   # one forward, rows under a1 and under no adapter
        logits = policy.model(input_ids=ids).logits
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
import weakref

import torch

from ..logs import get_logger
from ..errors import AdapterNotFoundError, InvalidRequestError
from .loader import _VISION_MARKERS  # vision-tower path parts: a decode step does not run them

logger = get_logger("unsloth_rollout")

BASE = "__base__"  # PEFT's name for "no adapter" in a mixed batch
_CONFIG = "adapter_config.json"
_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json settings refused (vLLM refuses DoRA, modules_to_save and trained biases too): each changes the
# base model shared with the trainer, or is a LoRA variant whose mixed-batch forward no test here proves exact.
_REFUSED = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "modules_to_save": "adapters with modules_to_save (fully trained copies of base modules) are not supported",
    "trainable_token_indices": "adapters with trainable_token_indices are not supported",
    "layer_replication": "adapters with layer_replication (they change the base model's layers) are not supported",
    "target_parameters": "adapters on nn.Parameter targets (target_parameters) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) adapters are not supported",
    "use_qalora": "QALoRA adapters (use_qalora) are not supported",
}
_SUFFIXES = (".lora_A.weight", ".lora_B.weight", ".lora_A.bias", ".lora_B.bias", ".lora_embedding_A",
             ".lora_embedding_B")


def _peft():
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return peft, (BaseTunerLayer, AuxiliaryTrainingWrapper)


def tuner_layers(model: torch.nn.Module) -> list:
    """Every PEFT layer of ``model`` whose adapter selection a forward may switch."""
    try:
        _, kinds = _peft()
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, kinds)]


# model -> (its adapters, [(layer, adapters the layer holds)]): a forward must not walk every module (a 3B model
# has thousands); rebuilt when the model's adapter set changes and by every load / unload here.
_INDEX: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _indexed(model: torch.nn.Module) -> list[tuple]:
    """[(layer, the adapters it holds, whether every decode step runs it: a decoder layer's, not the vision's)]."""
    key = tuple(sorted(getattr(model, "peft_config", {}) or {}))
    hit = _INDEX.get(model)
    if hit is None or hit[0] != key:
        ours = {id(m) for m in tuner_layers(model)}
        hit = (key, [(m, frozenset(m._get_available_adapters()),
                      ".layers." in n and not set(_VISION_MARKERS) & set(n.split(".")))
                     for n, m in model.named_modules() if id(m) in ours])
        _INDEX[model] = hit
    return hit[1]


# ============================================================================ one forward
@contextlib.contextmanager
def adapter_scope(model: torch.nn.Module, names: list[str] | None):
    """Run the forward inside with row i under adapter ``names[i]`` (``"__base__"``: none); None: as the model is.

    All rows under one adapter (every prefill, a decode step of one adapter): each layer is switched to it, the
    vision tower's included. Rows under different adapters (decode: no images): PEFT's mixed batch, on layers whose
    inputs are one per row; a layer reached with another first dimension fails the forward by name. Whatever it
    set, each layer's selection is put back and every hook removed when the block ends, also when it raises."""
    if names is None:
        yield
        return
    index = _indexed(model)
    layers = [m for m, _, _ in index]
    if any(getattr(m, "merged", False) for m in layers):
        raise RuntimeError("adapters selected by name cannot run on a model whose LoRA weights are merged")
    held = set().union(*(have for _, have, _ in index))
    unknown = sorted(set(names) - held - {BASE})
    if unknown:  # never run a request under the base model because its adapter is gone
        raise RuntimeError(f"adapter(s) {', '.join(map(repr, unknown))} not loaded in the model")
    # Plain attributes, written in __dict__: nn.Module.__setattr__ costs microseconds per layer per forward.
    saved = [(m.__dict__, m._active_adapter, m._disable_adapters) for m in layers]
    hooks = []
    try:
        if len(set(names)) == 1:
            name = names[0]
            for m, have, _ in index:
                if name != BASE and name in have:
                    m.__dict__["_active_adapter"], m.__dict__["_disable_adapters"] = [name], False
                else:  # this layer holds no weights of the adapter: the base layer alone
                    m.__dict__["_disable_adapters"] = True
        else:
            rows, called = list(names), set()

            def inject(module, args, kwargs, own):
                called.add(id(module))
                x = args[0] if args else next(iter(kwargs.values()), None)
                if not isinstance(x, torch.Tensor) or x.shape[0] != len(own):
                    raise RuntimeError(f"a forward mixing adapters reached a layer whose inputs are not one per row "
                                       f"({type(module).__name__}, first dimension "
                                       f"{getattr(x, 'shape', [None])[0]} for {len(own)} rows)")
                kwargs["adapter_names"] = own
                return args, kwargs

            for m, have, _ in index:
                m.__dict__["_disable_adapters"] = False
                own = [n if n in have else BASE for n in rows]  # its adapter skips this layer: the base (e.g. lm_head)
                hooks.append(m.register_forward_pre_hook(functools.partial(inject, own=own), with_kwargs=True))
        yield
        if hooks:  # a fused kernel that read a layer's weights without its forward ran one adapter for all rows
            wanted = set(rows) - {BASE}
            skipped = [m for m, have, decoder in index if decoder and id(m) not in called and wanted & have]
            if skipped:
                raise RuntimeError(f"a forward mixing adapters bypassed {len(skipped)} decoder LoRA layer(s) (e.g. "
                                   f"a {type(skipped[0]).__name__}): this backend cannot mix adapters in one batch")
    finally:
        for h in hooks:
            h.remove()
        for d, active, disabled in saved:
            d["_active_adapter"], d["_disable_adapters"] = active, disabled


@contextlib.contextmanager
def _preserved(model: torch.nn.Module):
    """Put back what PEFT's add/delete/unload change on the modules that stay: ``requires_grad`` and ``training``
    of every parameter and module (the trainer's), each layer's adapter selection and the model's active adapter."""
    params = [(p, p.requires_grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    layers = [(m, m._active_adapter, m._disable_adapters) for m in tuner_layers(model)]
    active = getattr(model, "active_adapter", None) if hasattr(model, "peft_config") else None
    try:
        yield
    finally:
        for p, g in params:
            p.requires_grad_(g)
        for m, t in modes:
            m.training = t
        for m, a, d in layers:
            have = m._get_available_adapters()
            m._active_adapter = [n for n in ([a] if isinstance(a, str) else a) if n in have] or a
            m._disable_adapters = d
        configs = getattr(model, "peft_config", {})
        if active is not None and active in configs:
            model.active_adapter = active
        elif configs and getattr(model, "active_adapter", None) not in configs:
            # PEFT takes the new active adapter from the first LoRA layer; when that layer held only the deleted
            # adapter (a vision-tower layer of a vision-LoRA adapter) it leaves the deleted name active, and every
            # later get_base_model() raises KeyError. Layers rest disabled on a serving wrapper: any valid name.
            model.active_adapter = next(iter(configs))
            if hasattr(model, "base_model") and hasattr(model.base_model, "active_adapter"):
                model.base_model.active_adapter = model.active_adapter


# ============================================================================ checks before anything loads
def read_adapter(policy, path: str, max_rank: int) -> tuple:
    """(LoraConfig, tensors) of the adapter folder ``path``, after every check that needs no change to the model:
    refused with InvalidRequestError (``lora_path``) naming the reason, AdapterNotFoundError when nothing is there."""
    cfg_path = os.path.join(str(path), _CONFIG)
    if not os.path.isdir(str(path)) or not os.path.isfile(cfg_path):
        raise AdapterNotFoundError("lora_path", f"No adapter found for {path!r} (no folder with {_CONFIG})")
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise InvalidRequestError("lora_path", f"{_CONFIG} in {path!r} cannot be read: {e}") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise InvalidRequestError("lora_path", f"only LoRA adapters can be served; {path!r} is {raw['peft_type']}")
    for key, why in _REFUSED.items():
        if raw.get(key):
            raise InvalidRequestError("lora_path", f"{why}: {path!r} sets {key}={raw[key]!r}")
    if raw.get("bias", "none") != "none":
        raise InvalidRequestError("lora_path", f"adapters that train the base model's biases (bias={raw['bias']!r}) "
                                               f"are not supported: they would change the shared model")
    ranks = [raw.get("r", 8)] + list((raw.get("rank_pattern") or {}).values())
    for r in ranks:
        if not isinstance(r, int) or r < 1:
            raise InvalidRequestError("lora_path", f"LoRA rank must be a positive integer, got {r!r}")
        if r > max_rank:
            raise InvalidRequestError("lora_path", f"LoRA rank {r} is greater than max_lora_rank {max_rank}")
    peft, _ = _peft()
    try:
        config = peft.LoraConfig.from_pretrained(str(path))
    except Exception as e:
        raise InvalidRequestError("lora_path", f"{_CONFIG} in {path!r} is not a valid LoRA config: {e}") from None
    config.inference_mode = True
    tensors = _read_weights(str(path))
    _check_fits(policy, path, raw, tensors, max_rank)
    return config, tensors


def _read_weights(path: str) -> dict:
    for fname in _WEIGHTS:
        f = os.path.join(path, fname)
        if not os.path.isfile(f):
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                tensors = load_file(f)
            else:
                tensors = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise InvalidRequestError("lora_path", f"cannot read {fname} in {path!r}: {type(e).__name__}: {e}") \
                from None
        if not isinstance(tensors, dict) or not tensors:
            raise InvalidRequestError("lora_path", f"{fname} in {path!r} holds no tensors")
        return tensors
    raise InvalidRequestError("lora_path", f"no adapter weights in {path!r} (expected one of {', '.join(_WEIGHTS)})")


def _check_fits(policy, path, raw: dict, tensors: dict, max_rank: int) -> None:
    """Every tensor addresses a module the served model has, with that module's shapes (an adapter trained for
    another base model is refused here); a differing ``base_model_name_or_path`` alone is only logged, since the
    same weights are often saved under another path."""
    base = policy.base_model
    for key, t in tensors.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            raise InvalidRequestError("lora_path", f"{path!r} holds tensor {key!r}, which is not a LoRA A/B weight")
        where = key[: -len(suffix)].removeprefix("base_model.model.")
        try:
            module = base.get_submodule(where)
        except AttributeError:
            raise InvalidRequestError(
                "lora_path", f"target module {where!r} of {path!r} does not exist in the served model (an adapter "
                f"for another base model?)") from None
        layer = getattr(module, "base_layer", module)
        rank = t.shape[0] if suffix.endswith(("A.weight", "embedding_A")) else (t.shape[-1] if t.dim() > 1 else None)
        if rank is not None and rank > max_rank:
            raise InvalidRequestError("lora_path", f"LoRA rank {rank} of {where!r} is greater than max_lora_rank "
                                                   f"{max_rank}")
        want = _expected_shape(layer, suffix, t)
        if want is not None and tuple(t.shape) != want:
            raise InvalidRequestError(
                "lora_path", f"{key} has shape {tuple(t.shape)} but the served model's {where!r} needs {want}: "
                f"an adapter for another base model")
    theirs = str(raw.get("base_model_name_or_path") or "").rstrip("/").rsplit("/", 1)[-1].lower()
    ours = str(policy.name_or_path or getattr(policy.config, "_name_or_path", "") or "").rstrip("/")
    ours = ours.rsplit("/", 1)[-1].lower()
    if theirs and ours and theirs != ours:
        logger.warning("unsloth_rollout: adapter %s was trained on %r, the served model is %r (shapes match)",
                       path, raw.get("base_model_name_or_path"), ours)


def _expected_shape(layer, suffix: str, t: torch.Tensor):
    """The shape ``t`` must have on ``layer`` (None: a layer kind without a fixed rule, left to PEFT)."""
    if isinstance(layer, torch.nn.Embedding):
        r = t.shape[0] if suffix.endswith("A") else t.shape[-1]
        return (r, layer.num_embeddings) if suffix.endswith("A") else (layer.embedding_dim, r)
    n_in, n_out = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
    if n_in is None or n_out is None:
        return None
    r = t.shape[0] if ".lora_A." in suffix else (t.shape[-1] if t.dim() > 1 else None)
    return {".lora_A.weight": (r, n_in), ".lora_B.weight": (n_out, r), ".lora_A.bias": (t.shape[0],),
            ".lora_B.bias": (n_out,)}[suffix]


# ============================================================================ load and unload
def load_adapter(policy, name: str, path: str, max_rank: int) -> None:
    """Add the adapter at ``path`` to ``policy.model`` (in place) as the one requests name ``name`` (reached through
    ``models/weights.py``, whose caller then calls ``engine.weights_changed``). Inside PEFT it gets a name of its own (``policy.served_adapters[name]``): a
    user's name may hold dots or be part of "lora_", which PEFT cannot take. The policy's own adapter stays active;
    a policy without one is wrapped in PEFT with every LoRA layer resting disabled, so its plain forward (the
    trainer's, unnamed requests) stays the base model's. Refused before anything changes when ``read_adapter``
    refuses; a load that fails later is undone."""
    if name in policy.served_adapters:
        raise InvalidRequestError("lora_name", f"The lora adapter '{name}' has already been loaded.")
    config, tensors = read_adapter(policy, path, max_rank)
    peft, _ = _peft()
    from peft.utils.save_and_load import set_peft_model_state_dict

    model = policy.model
    wrapped = isinstance(model, peft.PeftModel)
    taken = set(getattr(model, "peft_config", {})) if wrapped else set()
    inner = next(f"served_{k}" for k in range(1, len(taken) + 2) if f"served_{k}" not in taken)
    with policy.lock:
        new, old_params, old_modules = None, {id(p) for p in model.parameters()}, {id(m) for m in model.modules()}
        try:
            with _preserved(model):
                if wrapped:
                    model.add_adapter(inner, config)
                    target = model
                else:
                    new = target = peft.get_peft_model(model, config, adapter_name=inner)
                result = set_peft_model_state_dict(target, tensors, adapter_name=inner)
            pattern = re.compile(rf"\.lora_(A|B|embedding_A|embedding_B)\.{inner}(\.|$)")
            missing = [k for k in result.missing_keys if pattern.search(k)]
            if missing:
                raise InvalidRequestError("lora_path", f"{path!r} lacks weights for {len(missing)} of the modules its "
                                                       f"config targets, e.g. {missing[0]!r}")
        except Exception as e:
            _undo_load(model, new, inner)
            if isinstance(e, InvalidRequestError):
                raise
            raise InvalidRequestError("lora_path", f"cannot load adapter from {path!r}: {type(e).__name__}: {e}") \
                from None
        if new is not None:
            policy.model = new
            policy.serving_wrapper = True
        if policy.serving_wrapper:
            for m in tuner_layers(policy.model):  # at rest: the plain model
                m._disable_adapters = True
        for p in policy.model.parameters():
            if id(p) not in old_params:  # served adapters are never trained here
                p.requires_grad_(False)
        for m in policy.model.modules():
            if id(m) not in old_modules:  # PEFT builds them in training mode: a dropout would sample
                m.training = model.training
        policy.served_adapters[name] = inner
        _INDEX.pop(policy.model, None)


def _undo_load(model, new, name: str) -> None:
    try:
        with _preserved(model):
            if new is not None:
                _strip_peft(new.unload())
            elif name in getattr(model, "peft_config", {}):
                model.delete_adapter(name)
    except Exception:  # never mask the load's own error; the model may hold a stray adapter, logged
        logger.exception("unsloth_rollout: undoing a failed load of adapter %r failed", name)


def _strip_peft(base: torch.nn.Module) -> torch.nn.Module:
    """After ``PeftModel.unload()``: the plain model, without the ``peft_config`` PEFT left on it (which made it
    look like a PEFT model to the next load)."""
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in base.__dict__:
            delattr(base, attr)
    return base


def unload_adapter(policy, name: str) -> None:
    """Remove the served adapter ``name`` from ``policy.model`` (in place); unloading the last one of a policy
    wrapped only to serve adapters gives back the plain model, so a later load starts from it again."""
    model = policy.model
    with policy.lock:
        inner = policy.served_adapters.pop(name)
        _INDEX.pop(model, None)
        if policy.serving_wrapper and set(model.peft_config) == {inner}:
            with _preserved(model):
                base = model.unload()
            policy.model = _strip_peft(base)
            policy.serving_wrapper = False
            return
        with _preserved(model), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*was active which is now deleted")  # rests disabled anyway
            model.delete_adapter(inner)


def unnamed_adapter(policy) -> str | None:
    """The adapter rows without a name run under: ``"__base__"`` on a policy wrapped only to serve adapters,
    else None (the model's active adapter, the policy's own)."""
    return BASE if getattr(policy, "serving_wrapper", False) else None
