"""Served-adapter fixtures for tests: every served VLM family by one name, PEFT adapters with LoRA on the vision
tower saved to disk, and the oracle model that runs one of them from fresh weights.

Example::

    path = family_path("gemma3")
    save_adapter(path, "/tmp/a1", seed=1)                   # LoRA on language and vision layers, non-zero B
    oracle = adapter_oracle(path, "/tmp/a1")                # a PolicyModel with only that adapter, for HF generate
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.families import served_families
from .oracles import perturb_lora

VLM_SERVED = served_families(vlm=True)  # every VLM family the engine serves (tiny builds: families.family_path)


def images(n: int, seed: int = 0) -> list:
    """``n`` random RGB images of varied sizes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(64, 48), (40, 90), (56, 56), (30, 70), (84, 28)]
    return [Image.fromarray(rng.integers(0, 255, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


def lora_policy(path: str, seed: int = 0, r: int = 8, std: float = 0.3, **lora):
    """``load_model(path)`` with LoRA (Unsloth's default targets: language and vision layers), B non-zero."""
    from ..models import load_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # LoRA A init draws from the global RNG
        policy = load_model(path, backend="transformers", lora={"r": r, **lora})
    assert perturb_lora(policy.model, std=std, seed=seed) > 0
    return policy


def save_adapter(path: str, out, seed: int = 1, r: int = 4, std: float = 0.3, **lora) -> str:
    """Save a PEFT adapter for the model at ``path`` to ``out`` (a VLM's with LoRA on the vision tower too); returns
    ``out``."""
    policy = lora_policy(path, seed=seed, r=r, std=std, lora_alpha=2 * r, **lora)
    names = [n for n, _ in policy.model.named_parameters() if "lora_B" in n]
    assert not policy.is_vlm or any("visual" in n or "vision" in n for n in names), "no LoRA on the vision tower"
    policy.model.save_pretrained(str(out))
    return str(out)


def save_peft_adapter(model_dir: str, out, seed: int = 0, std: float = 0.5):
    """A PEFT LoRA (r=4 on q/v/o) of the HF model in ``model_dir`` with seeded random B (its outputs differ from the
    base's), saved to ``out``; returns ``(str(out), the PEFT model in eval mode)`` (the oracle's own forward)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)  # a non-zero update: outputs change
    model.save_pretrained(out)
    return str(out), model.eval()


def adapter_oracle(path: str, adapter: str | None = None):
    """A PolicyModel of fresh weights from ``path`` running only ``adapter`` (None: the plain model)."""
    from ..models import load_model

    policy = load_model(path, backend="transformers")
    if adapter is not None:
        from peft import PeftModel

        policy.model = PeftModel.from_pretrained(policy.model, adapter, is_trainable=False).eval()
    return policy


def processor_inputs(policy, messages: list, imgs: list | None) -> dict:
    """The processor's own encoding of a chat request (what a trainer feeds the model)."""
    text = policy.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(policy.processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt"))


def hf_greedy(policy, inputs: dict, max_new: int, suppress: list[int]) -> list[int]:
    """HF ``generate()`` greedy tokens of one encoded prompt (the oracle for greedy parity)."""
    inputs = {k: v.to(policy.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(policy.dtype)
    policy.clear_rope_deltas()
    with torch.no_grad():
        out = policy.model.generate(**inputs, max_new_tokens=max_new, do_sample=False,
                                    suppress_tokens=suppress or None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def bad_adapters(good: str, out) -> dict[str, tuple[str, int, str]]:
    """Variants of the adapter folder ``good`` that a server must refuse, written under ``out``:
    ``{kind: (path, HTTP status, a phrase the error message holds)}`` (status 404 only for a missing folder).
    Ranks above a limit are not here: refuse them with ``max_lora_rank`` below the adapter's rank."""
    import json
    import pathlib
    import shutil

    from safetensors.torch import load_file, save_file

    out = pathlib.Path(out)
    made: dict[str, tuple[str, int, str]] = {}

    def variant(kind: str, status: int, phrase: str, config=None, tensors=None, weights: bytes | None = None):
        d = out / kind
        shutil.copytree(good, d)
        if config is not None:
            cfg = json.loads((d / "adapter_config.json").read_text())
            config(cfg)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        if tensors is not None:
            t = tensors(load_file(str(d / "adapter_model.safetensors")))
            if t is None:
                (d / "adapter_model.safetensors").unlink()
            else:
                save_file(t, str(d / "adapter_model.safetensors"))
        if weights is not None:
            (d / "adapter_model.safetensors").write_bytes(weights)
        made[kind] = (str(d), status, phrase)

    variant("dora", 400, "DoRA", config=lambda c: c.update(use_dora=True))
    variant("modules_to_save", 400, "modules_to_save", config=lambda c: c.update(modules_to_save=["lm_head"]))
    variant("bias", 400, "bias", config=lambda c: c.update(bias="all"))
    variant("missing_module", 400, "does not exist in the served model",
            config=lambda c: c.update(target_modules=["qx_proj"]),
            tensors=lambda t: {k.replace("q_proj", "qx_proj"): v for k, v in t.items()})
    g = torch.Generator().manual_seed(0)
    variant("other_base_model", 400, "another base model",  # same module names, a wider model's shapes
            config=lambda c: c.update(base_model_name_or_path="someone/wider-model"),
            tensors=lambda t: {k: torch.randn([2 * s if i == (1 if "lora_A" in k else 0) else s
                                               for i, s in enumerate(v.shape)], generator=g) for k, v in t.items()})
    variant("corrupt_weights", 400, "cannot read adapter_model.safetensors", weights=b"\x00not a safetensors file")
    variant("missing_weights", 400, "no adapter weights", tensors=lambda t: None)
    variant("bad_config", 400, "cannot be read")
    (out / "bad_config" / "adapter_config.json").write_text("{not json")
    made["missing_folder"] = (str(out / "no-such-adapter"), 404, "No adapter found")
    return made
