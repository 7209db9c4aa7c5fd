"""The models one differential-test family runs on: the served policy, an independent reference, named adapters.

Building a model is the slow part of a mix, so ``family_models(family, policy_lora)`` builds once per process
and caches: the policy the engine serves (tiny random model of the family, LoRA r=8 with random B when
``policy_lora``), two adapter folders on disk (``a1``: LoRA where the policy's config puts it, the vision tower
included on a VLM; ``a2``: language-model layers only), and a *reference*: a second model object built the same
way from disk with the same adapters loaded by name, which the engine never touches. Oracles (HF ``generate()``
and teacher-forced forwards) run on the reference; a mix that leaves the policy different from it shows up in
``FamilyModels.state_errors()``. Weight changes are applied to both (``shift_policy``).
"""

from __future__ import annotations

import contextlib
import tempfile

import torch

from ..models.families import family_of, served_families
from .families import family_path
from .oracles import perturb_lora

TEXT_FAMILIES = ("qwen2",) + tuple(f for f in served_families(vlm=False) if f != "qwen2")
VISION_FAMILIES = served_families(vlm=True)
ALL_FAMILIES = TEXT_FAMILIES + VISION_FAMILIES
# Gemma 2's attention soft-capping exists only in its eager attention (transformers' sdpa drops it).
ATTN = {"gemma2": "eager"}
NAMED = ("a1", "a2")


def _load(family: str, lora):
    from .. import load_model

    torch.manual_seed(0)  # LoRA A init draws from the global RNG: every build of a family is the same model
    return load_model(family_path(family), backend="transformers", lora=lora,
                      attn_implementation=ATTN.get(family, "sdpa"))


def _hook_count(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


class FamilyModels:
    """Policy, reference and adapter folders of one family (see module docstring)."""

    def __init__(self, family: str, policy_lora: bool):
        self.family, self.policy_lora = family, policy_lora
        self.is_vlm = family_of(family).vlm
        self._tmp = tempfile.TemporaryDirectory(prefix=f"difftest-{family}-")
        self.adapter_dirs = {}
        ref = _load(family, {"r": 8})
        for name, seed in (("a1", 1), ("a2", 2)):
            src = ref
            if name == "a2" and self.is_vlm:  # language layers only: no LoRA on the vision tower
                src = _load(family, {"r": 8, "finetune_vision_layers": False})
            perturb_lora(src.model, std=0.2, seed=seed)  # 0.3 doubles the fp32 noise to ~1e-5 on some families
            self.adapter_dirs[name] = f"{self._tmp.name}/{name}"
            src.model.save_pretrained(self.adapter_dirs[name])
        perturb_lora(ref.model, std=0.3, seed=0)  # the policy's own adapter, "default"
        for name, path in self.adapter_dirs.items():
            ref.model.load_adapter(path, adapter_name=name, is_trainable=False)
        ref.model.set_adapter("default")
        self.reference = ref
        self.policy = _load(family, {"r": 8} if policy_lora else None)
        if policy_lora:
            perturb_lora(self.policy.model, std=0.3, seed=0)
        self.model_type = type(self.policy.model)
        self._logits(self.policy, train=False)  # transformers installs its output-capturing hooks at a first forward
        self.hooks = _hook_count(self.policy.model)
        self.version_weights = {0: self._default_b(ref.model)}  # weights of the policy's adapter per version
        self.broken = False

    # ------------------------------------------------------------------ weights
    @staticmethod
    def _default_b(model) -> dict:
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_B.default." in n}

    def shift_policy(self, seed: int, version: int) -> None:
        """An optimizer step's worth of change to the policy's adapter, applied to policy and reference alike."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            ref = dict(self.reference.model.named_parameters())
            for n, p in sorted(self.policy.model.named_parameters()):
                if ".lora_B.default." in n:
                    delta = torch.randn(p.shape, generator=g) * 0.05
                    p.add_(delta.to(p.dtype))
                    ref[n].add_(delta.to(p.dtype))
        self.version_weights[version] = self._default_b(self.reference.model)

    def set_reference_version(self, version: int) -> None:
        with torch.no_grad():
            params = dict(self.reference.model.named_parameters())
            for n, w in self.version_weights[version].items():
                params[n].copy_(w)

    def rebase_versions(self, latest: int) -> None:
        """After a mix: the weights of ``latest`` are the family's version 0 for the next engine."""
        self.set_reference_version(latest)
        self.version_weights = {0: self.version_weights[latest]}

    @contextlib.contextmanager
    def reference_adapter(self, name: str | None):
        """The reference running what a row with ``lora_name=name`` should run."""
        model = self.reference.model
        if name is None and not self.policy_lora:
            with model.disable_adapter():
                yield self.reference
            return
        model.set_adapter(name or "default")
        try:
            yield self.reference
        finally:
            model.set_adapter("default")

    # ------------------------------------------------------------------ state after a mix
    def probe_inputs(self) -> dict:
        tok = self.policy.tokenizer
        if not self.is_vlm:
            ids = tok.encode("the quick brown fox jumps over a lazy dog while Alice counts")
            return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        from .differential_checks import make_images, processor_inputs

        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "the quick brown fox"}]}]
        return processor_inputs(self.policy, msgs, make_images([(40, 56)], seed=5))

    def state_errors(self, engine_adapters=()) -> list[str]:
        """How the policy differs from a fresh model after a mix (empty: it does not)."""
        model, errors = self.policy.model, []
        if type(model) is not self.model_type:
            errors.append(f"policy.model is a {type(model).__name__}, was a {self.model_type.__name__}")
        if _hook_count(model) != self.hooks:
            errors.append(f"{_hook_count(model) - self.hooks} forward hook(s) left on the policy (PEFT adapter_names?)")
        if self.policy_lora and getattr(model, "active_adapter", None) != "default":
            errors.append(f"active adapter is {getattr(model, 'active_adapter', None)!r}, not 'default'")
        left = set(getattr(model, "peft_config", {}) or {}) - {"default"}
        if left:
            errors.append(f"adapters still on the policy after unloading: {sorted(left)}")
        with self.reference_adapter(None):
            want = self._logits(self.reference, train=False)
        for mode in ("eval", "train"):  # the engine's unnamed rows and the trainer's own forward
            try:
                got = self._logits(self.policy, train=mode == "train")
            except Exception as e:  # noqa: BLE001 - a forward that raises is the finding
                errors.append(f"plain {mode} forward of the policy raises {type(e).__name__}: {e}")
                continue
            diff = (got - want).abs().max().item()
            if not diff <= 1e-5:
                errors.append(f"plain {mode} forward of the policy differs from a fresh model's by {diff:.2e}")
        return errors

    def _logits(self, policy, train: bool) -> torch.Tensor:
        inputs = self.probe_inputs()
        with policy.lock, torch.no_grad():
            policy.clear_rope_deltas()
            was = policy.model.training
            policy.model.train(train)
            try:
                return policy.model(**inputs, use_cache=False).logits.float()
            finally:
                policy.model.train(was)
                policy.clear_rope_deltas()


_CACHE: dict[tuple[str, bool], FamilyModels] = {}


def family_models(family: str, policy_lora: bool = True) -> FamilyModels:
    """The cached models of ``family`` (rebuilt when a mix left them broken)."""
    key = (family, policy_lora)
    fm = _CACHE.get(key)
    if fm is None or fm.broken:
        fm = _CACHE[key] = FamilyModels(family, policy_lora)
    return fm
