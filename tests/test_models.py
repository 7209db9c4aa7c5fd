"""Foundation: offline tiny models, load_model over both backends, LoRA placement, mode switching, 4-bit."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from unsloth_rollout.testing.toy import random_images
from unsloth_rollout import load_model
from unsloth_rollout.models import BackendUnavailableError
from unsloth_rollout.testing.tiny import build_tiny_model

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _digest(path):
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_import_is_light():
    code = ("import sys, unsloth_rollout; bad = [m for m in ('areal', 'fastapi', 'trl', 'unsloth', 'uvicorn') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl", "qwen2_5_vl"])
def test_builders_load_through_auto_classes(tmp_path, arch):
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor,
                              AutoTokenizer)

    a = build_tiny_model(arch, "tiny", out=tmp_path / "a", seed=3)
    b = build_tiny_model(arch, "tiny", out=tmp_path / "b", seed=3)
    assert _digest(a) == _digest(b), "same seed must give the same weights"
    cfg = AutoConfig.from_pretrained(a)
    tok = AutoTokenizer.from_pretrained(a)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert cfg.get_text_config().vocab_size >= len(tok)
    cls = AutoModelForCausalLM if arch == "qwen2" else AutoModelForImageTextToText
    model = cls.from_pretrained(a)
    n = sum(p.numel() for p in model.parameters())
    assert n < 2_000_000
    msgs = [{"role": "user", "content": "hi"}]
    assert "<|im_start|>assistant" in tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if arch != "qwen2":
        assert cfg.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
        try:  # without torchvision this raises, or silently gives a bare tokenizer: load_model must cope
            AutoProcessor.from_pretrained(a)
        except ImportError:
            pass
        policy = load_model(str(a))
        assert hasattr(policy.processor, "image_processor") and hasattr(policy.processor, "tokenizer")
        text = policy.processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
            tokenize=False, add_generation_prompt=True)
        enc = policy.processor(text=[text], images=random_images(1), return_tensors="pt")
        out = policy.model.generate(**enc, max_new_tokens=3, do_sample=False)
        assert out.shape[1] == enc["input_ids"].shape[1] + 3


def test_cli_builds_and_load_model_picks_transformers_for_a_vlm(tmp_path):
    d = tmp_path / "d"
    r = subprocess.run([sys.executable, "-m", "unsloth_rollout.testing.tiny", "--arch", "qwen2_5_vl", "--size", "tiny",
                        "--out", str(d)], env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "from unsloth_rollout import load_model; "
                        f"p = load_model({str(d)!r}, lora={{'r': 8}}); print(p.backend, p.is_vlm)"],
                       env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "transformers True"


@pytest.mark.parametrize("vision", [True, False])
def test_lora_on_the_vision_tower_when_asked(qwen2_5_vl_dir, vision):
    policy = load_model(qwen2_5_vl_dir, backend="transformers", lora={"r": 4, "finetune_vision_layers": vision})
    names = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    in_vision = [n for n in names if ".visual." in n]
    in_language = [n for n in names if ".language_model." in n]
    assert bool(in_vision) == vision
    assert in_language
    frozen = [n for n, p in policy.model.named_parameters() if not p.requires_grad]
    assert any("visual" in n for n in frozen)


def test_lora_flags_select_attention_or_mlp(qwen2_dir):
    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 4, "finetune_mlp_modules": False})
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in policy.model.named_parameters() if p.requires_grad}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_inference_excursion_leaves_training_unaffected(qwen2_5_vl_dir):
    policy = load_model(qwen2_5_vl_dir, backend="transformers", lora={"r": 4, "lora_dropout": 0.0},
                        gradient_checkpointing=True)
    text = policy.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Alice counts twelve apples"}]}],
        tokenize=False, add_generation_prompt=True)
    enc = dict(policy.processor(text=[text], images=random_images(1), return_tensors="pt"))
    enc.pop("attention_mask", None)
    ids = enc["input_ids"]

    def loss():
        torch.manual_seed(0)
        policy.clear_rope_deltas()
        out = policy.model(**enc, labels=ids)
        out.loss.backward()
        grads = [p.grad.clone() for p in policy.model.parameters() if p.requires_grad]
        policy.model.zero_grad()
        return out.loss.item(), grads

    policy.training()
    assert policy.model.training and policy.base_model.is_gradient_checkpointing
    before, g_before = loss()
    with policy.inference():
        assert not policy.model.training and not policy.base_model.is_gradient_checkpointing
        assert policy.tokenizer.padding_side == "left"
        policy.model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert policy.model.training and policy.base_model.is_gradient_checkpointing
    assert policy.tokenizer.padding_side == "right"
    after, g_after = loss()
    assert len(g_before) == len(g_after) > 0
    assert before == after
    assert all(torch.equal(a, b) for a, b in zip(g_before, g_after))


def test_wrap_an_existing_model(qwen2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unsloth_rollout import PolicyModel

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    policy = PolicyModel.wrap(model, AutoTokenizer.from_pretrained(qwen2_dir))
    assert policy.backend == "transformers" and not policy.is_vlm and policy.model is model


def test_clear_errors(tmp_path, qwen2_5_vl_dir):
    with pytest.raises(FileNotFoundError, match="not a local model folder"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="backend must be one of"):
        load_model(qwen2_5_vl_dir, backend="vllm")
    with pytest.raises(ValueError, match="unknown option"):
        load_model(qwen2_5_vl_dir, lora={"rank": 8})
    if not torch.cuda.is_available():
        reason = "CPU backend loads only text models" if importlib.util.find_spec("unsloth") else "not installed"
        with pytest.raises(BackendUnavailableError, match=reason):
            load_model(qwen2_5_vl_dir, backend="unsloth")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_4bit_path_runs_on_cpu_with_engine_parity(qwen2_dir):
    from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams

    policy = load_model(qwen2_dir, backend="transformers", load_in_4bit=True, lora={"r": 4})
    kinds = {type(m).__name__ for m in policy.model.modules()}
    assert "Linear4bit" in kinds, kinds
    ids = policy.tokenizer.encode("Alice counts apples")
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20))
    out = engine.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=8,
                                                                                    temperature=0))])[0]
    engine.shutdown()
    ref = policy.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert out.output_ids == ref.tolist()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_4bit_vlm_keeps_vision_tower_and_lm_head_in_full_precision(qwen2_5_vl_dir):
    """Only the language model's linear layers are quantized (the loader's skip list must match
    transformers 5's module paths, e.g. model.visual.blocks.0.attn.qkv)."""
    policy = load_model(qwen2_5_vl_dir, backend="transformers", load_in_4bit=True, dtype=torch.float32)
    quantized = [n for n, m in policy.model.named_modules() if type(m).__name__ == "Linear4bit"]
    assert quantized and all(".language_model." in n for n in quantized), quantized
    assert policy.model.lm_head.weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in policy.model.model.visual.parameters())


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth extra not installed")
def test_unsloth_backend_on_a_text_model(qwen2_dir):
    """Unsloth patches transformers globally on import, so this runs in its own process."""
    code = textwrap.dedent(f"""
        import torch
        from unsloth_rollout import load_model, RolloutEngine, EngineConfig, GenerationRequest, SamplingParams
        p = load_model({qwen2_dir!r}, backend="auto", lora={{"r": 8}})
        assert p.backend == "unsloth", p.backend
        for n, prm in p.model.named_parameters():
            if "lora_B" in n:
                prm.data.normal_(0, 0.3)
        eng = RolloutEngine(p, EngineConfig(kv_cache_memory_bytes=8 << 20))
        ids = p.tokenizer.encode("Alice counts apples")
        o = eng.generate([GenerationRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=12,
                                                                                 temperature=0))])[0]
        p.inference()
        ref = p.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
        assert o.output_ids == ref.tolist(), (o.output_ids, ref.tolist())
        with p.training():
            assert p.model.training
        print("OK", p.backend)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "OK unsloth" in r.stdout
