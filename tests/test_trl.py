"""TRL's real GRPOTrainer (trl 1.16) generating through the engine via ``rollout_func``.

Oracles: TRL's own recomputed per-token logprobs (its importance-sampling branch logs
``sampling/sampling_logp_difference/max`` = max |engine logprob - TRL's forward|), a teacher-forced forward,
and HF ``generate()`` for greedy outputs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("trl")
pytestmark = pytest.mark.trl
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from unsloth_rollout.testing.oracles import teacher_forced, teacher_forced_logprobs  # noqa: E402
from unsloth_rollout import EngineConfig, InvalidRequestError, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.trl import rollout_func, sampling_params_from_trainer  # noqa: E402
from unsloth_rollout.testing.trl_toy import grpo_config, toy_dataset, toy_reward  # noqa: E402
from unsloth_rollout.trl.toy import run_toy_grpo  # noqa: E402

TOL = 1e-5
# After updates (lr 3e-2 on a tiny model) logits sharpen and an unlikely token's logprob (|lp| ~ 15) carries fp32
# noise of ~1e-5 in both forwards; stale weights would be off by ~1e-2 or more.
LATER_TOL = 1e-4
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
       "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                      os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])}


def _trainer(policy, engine, tmp_path, steps, ds, **cfg):
    from trl import GRPOTrainer

    rf = rollout_func(engine)
    tr = GRPOTrainer(model=policy.model, processing_class=policy.processor or policy.tokenizer,
                     reward_funcs=toy_reward(engine.eos_ids), args=grpo_config(str(tmp_path), steps, **cfg),
                     train_dataset=ds, rollout_func=rf)
    return tr, rf


def _logged(tr, key):
    return [h[key] for h in tr.state.log_history if key in h]


def test_grpo_learns_toy_reward_vlm(tmp_path):
    """Vision + language LoRA on the tiny Qwen2.5-VL, dataset `image` column: mean reward rises."""
    rec = run_toy_grpo("tiny-vlm", steps=30, out=str(tmp_path / "curve"), seed=0, output_dir=str(tmp_path / "o"))
    assert (tmp_path / "curve.json").exists()
    start, end = rec["start_mean_reward"], rec["end_mean_reward"]
    assert end >= 3 * start and end >= 0.5, f"reward {start:.3f} -> {end:.3f}: {rec['mean_reward']}"
    # every rollout sampled with the version of the step it was made at, and TRL's recompute agrees with it
    assert rec["rollout_versions"] == [[s] for s in rec["rollout_global_steps"]] == [[s] for s in range(30)]
    diffs = rec["sampling_logp_difference_max"]
    assert diffs[0] <= TOL and max(diffs) <= LATER_TOL, diffs


def test_logprobs_match_trl_and_versions_follow_steps(qwen2_5_vl_dir, tmp_path):
    """`images` column; behaviour logprobs == TRL's recompute (step 1 and after updates); no weight copy."""
    policy = load_model(qwen2_5_vl_dir, backend="transformers",
                        lora={"r": 8, "finetune_vision_layers": True, "random_state": 0})
    assert any("visual" in n and "lora_A" in n for n, _ in policy.model.named_parameters())
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20), seed=0)
    ptrs = {n: p.data_ptr() for n, p in policy.model.named_parameters()}
    lora0 = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_B" in n}
    # a float32 trainer: TRL's recompute is then an exact oracle of the engine's logprobs
    tr, rf = _trainer(policy, engine, tmp_path, 3, toy_dataset(6, "images"), num_generations=4,
                      prompts_per_step=2, max_completion_length=6, bf16=False)
    stats0 = engine.stats()
    tr.train()

    diffs = _logged(tr, "sampling/sampling_logp_difference/max")
    # step 1 (before any update), then after each update
    assert len(diffs) == 3 and diffs[0] <= TOL and max(diffs) <= LATER_TOL, diffs
    assert [h["global_step"] for h in rf.history] == [0, 1, 2]
    assert [h["versions"] for h in rf.history] == [[0], [1], [2]]
    assert engine.version == 3
    # one request per group (n = num_generations), 2 groups per step
    assert [h["requests"] for h in rf.history] == [2, 2, 2] and [h["samples"] for h in rf.history] == [8, 8, 8]
    assert engine.stats()["requests"] - stats0["requests"] == 6
    # the optimizer changed the LoRA weights in place: same storage, new values
    assert ptrs == {n: p.data_ptr() for n, p in policy.model.named_parameters()}
    assert max((p - lora0[n]).abs().max().item() for n, p in policy.model.named_parameters() if n in lora0) > 1e-3

    # The last rollout (version 2) against a teacher-forced forward of the weights as they were then: the
    # weights after step 2 are gone, so re-check on a fresh rollout at the current version instead, and show
    # that the adapter's update matters (the base weights alone are far off).
    o = rf.last_outputs[0]
    assert o.output_versions == [2] * len(o.output_ids)
    from unsloth_rollout import GenerationRequest, SamplingParams

    img = toy_dataset(6, "images")[0]["images"][0]
    req = GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "image": img},
                                                                   {"type": "text", "text": "Describe it."}]}],
                            sampling=SamplingParams(max_new_tokens=6, seed=3))
    out = engine.generate([req])[0]
    assert out.output_versions == [3] * 6
    enc = policy.processor.image_processor(images=[img], return_tensors="pt")
    kw = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    ref, _ = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, **kw)
    assert (ref - torch.tensor(out.output_logprobs)).abs().max().item() <= TOL
    with policy.model.disable_adapter():
        base, _ = teacher_forced_logprobs(policy, out.prompt_ids, out.output_ids, **kw)
    assert (base - torch.tensor(out.output_logprobs)).abs().max().item() > 1e-3
    engine.shutdown()


def test_greedy_stop_tokens_and_groups_on_a_text_model(qwen2_dir, tmp_path):
    """generation_kwargs reach the engine: do_sample=False is HF greedy, stop_token_ids cut the completion. Under
    GRPOConfig's default precision (bf16 mixed precision): the engine's tokens are the float32 model's."""
    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 4, "random_state": 0})
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=8 << 20), seed=0)
    ds = toy_dataset(2, None)
    tok = policy.tokenizer
    refs = []
    for row in ds:
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = torch.tensor([ids["input_ids"]])
        with torch.no_grad():
            refs.append(policy.model.generate(input_ids=ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
                        .tolist())
    stop = refs[0][3]
    tr, rf = _trainer(policy, engine, tmp_path, 1, ds, num_generations=3, prompts_per_step=2,
                      max_completion_length=10, generation_kwargs={"do_sample": False, "stop_token_ids": [stop]},
                      shuffle_dataset=False)
    prefill0 = engine.stats()["prefill_tokens"]
    tr.train()
    outs = rf.last_outputs
    assert len(outs) == 6 and rf.history[0]["requests"] == 2
    for i, ref in enumerate(refs):
        cut = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert [o.output_ids for o in outs[3 * i: 3 * i + 3]] == [cut] * 3, (i, cut)
    # the 3 samples of a group share one prefill of their prompt
    assert engine.stats()["prefill_tokens"] - prefill0 == sum(len(outs[3 * i].prompt_ids) for i in range(2))
    engine.shutdown()


def test_engine_built_lazily_on_the_trainers_model(qwen2_dir, tmp_path):
    """`rollout_func()` with no engine: built on first call over trainer.model (PEFT-wrapped by TRL here). Under
    GRPOConfig's default precision the engine is built, and samples, on a model whose forward accelerate has wrapped
    in bf16 autocast: its compiled step still warms up, and its logprobs are the float32 model's (teacher-forced,
    outside autocast)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(qwen2_dir)
    tok = AutoTokenizer.from_pretrained(qwen2_dir)
    rf = rollout_func(engine_config=EngineConfig(kv_cache_memory_bytes=8 << 20), seed=0)
    tr = GRPOTrainer(model=model, processing_class=tok, reward_funcs=toy_reward([tok.eos_token_id]),
                     args=grpo_config(str(tmp_path), 2, num_generations=2, prompts_per_step=2),
                     train_dataset=toy_dataset(4, None), rollout_func=rf,
                     peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    checked = []
    run = rf.run

    def run_checked(requests, n, trainer):  # each step's rollout against the weights it was sampled from
        outs = run(requests, n, trainer)
        for o in outs:
            want, _ = teacher_forced(rf.engine.policy, o.prompt_ids, o.output_ids)
            checked.append((want - torch.tensor(o.output_logprobs)).abs().max().item())
        return outs

    rf.run = run_checked
    tr.train()
    assert tr.args.bf16 and "forward" in vars(tr.model)  # TRL's default: accelerate's bf16 autocast wrapper
    assert rf.engine.policy.model is tr.model and rf.engine.version == 2
    assert rf.engine.stats()["decode_backend_fallback"] is None
    assert len(checked) == 8 and max(checked) <= TOL, checked
    assert len(_logged(tr, "sampling/sampling_logp_difference/max")) == 2  # TRL's correction saw every step
    rf.engine.shutdown()


def test_trainer_settings_map_to_sampling_params():
    from types import SimpleNamespace

    def fake(**gk):
        return SimpleNamespace(max_completion_length=12, temperature=0.7, top_p=0.9, top_k=0, min_p=None,
                               repetition_penalty=1.1, eos_token_ids=[5, 7], args=SimpleNamespace(generation_kwargs=gk))

    sp = sampling_params_from_trainer(fake(), n=4)
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty, sp.n) == \
        (12, 0.7, 0.9, -1, 0.0, 1.1, 4)
    assert sp.stop_token_ids == [5, 7]
    sp = sampling_params_from_trainer(fake(max_tokens=3, top_k=20, stop=["\n\n"], eos_token_id=9,
                                           presence_penalty=0.5, min_tokens=1), n=2)
    assert (sp.max_new_tokens, sp.top_k, sp.stop, sp.stop_token_ids, sp.presence_penalty, sp.min_new_tokens) == \
        (3, 20, ["\n\n"], [5, 7, 9], 0.5, 1)
    with pytest.raises(InvalidRequestError, match="generation_kwargs.num_beams") as e:
        sampling_params_from_trainer(fake(num_beams=4), n=1)
    assert e.value.field == "generation_kwargs.num_beams"
    with pytest.raises(InvalidRequestError, match="top_p"):
        sampling_params_from_trainer(fake(top_p=0.0), n=1)


def test_engine_on_another_model_is_refused(qwen2_dir, tmp_path):
    trained = load_model(qwen2_dir, backend="transformers", lora={"r": 4})
    other = load_model(qwen2_dir, backend="transformers", lora={"r": 4})
    engine = RolloutEngine(other, EngineConfig(kv_cache_memory_bytes=8 << 20))
    from trl import GRPOTrainer

    tr = GRPOTrainer(model=trained.model, processing_class=trained.tokenizer, reward_funcs=toy_reward([0]),
                     args=grpo_config(str(tmp_path), 1, num_generations=2, prompts_per_step=1),
                     train_dataset=toy_dataset(2, None), rollout_func=rollout_func(engine))
    with pytest.raises(ValueError, match="different model than the trainer trains"):
        tr.train()
    engine.shutdown()


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is None, reason="unsloth extra not installed")
def test_unsloth_first_text_model(qwen2_dir, tmp_path):
    """`import unsloth` first (it patches transformers/TRL at import), FastLanguageModel's CPU backend."""
    code = textwrap.dedent(f"""
        import unsloth
        from unsloth import FastLanguageModel
        from trl import GRPOTrainer
        from unsloth_rollout import load_model, RolloutEngine, EngineConfig
        from unsloth_rollout.trl import rollout_func
        from unsloth_rollout.testing.trl_toy import toy_dataset, toy_reward, grpo_config
        p = load_model({qwen2_dir!r}, backend="unsloth", lora={{"r": 8, "random_state": 0}})
        assert p.backend == "unsloth", p.backend
        eng = RolloutEngine(p, EngineConfig(kv_cache_memory_bytes=16 << 20), seed=0)
        rf = rollout_func(eng)
        ptrs = {{n: q.data_ptr() for n, q in p.model.named_parameters()}}
        lora0 = {{n: q.detach().clone() for n, q in p.model.named_parameters() if "lora_B" in n}}
        tr = GRPOTrainer(model=p.model, processing_class=p.tokenizer, reward_funcs=toy_reward(eng.eos_ids),
                         args=grpo_config({str(tmp_path)!r}, 3, bf16=False), train_dataset=toy_dataset(8, None),
                         rollout_func=rf)
        tr.train()
        diffs = [h["sampling/sampling_logp_difference/max"] for h in tr.state.log_history
                 if "sampling/sampling_logp_difference/max" in h]
        assert len(diffs) == 3 and diffs[0] <= {TOL} and max(diffs) <= {LATER_TOL}, diffs
        assert [h["versions"] for h in rf.history] == [[0], [1], [2]], rf.history
        assert ptrs == {{n: q.data_ptr() for n, q in p.model.named_parameters()}}
        assert max((q - lora0[n]).abs().max().item() for n, q in p.model.named_parameters() if n in lora0) > 1e-3
        print("OK", p.backend, max(diffs))
    """)
    r = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "OK unsloth" in r.stdout


def test_bench_trl_workload_runs_both_paths(tmp_path, capsys):
    """`python -m unsloth_rollout.bench --workload trl` at a tiny size: both paths fill the same batch."""
    import json

    from unsloth_rollout.bench.__main__ import main

    out = tmp_path / "trl.json"
    assert main(["--workload", "trl", "--model", "tiny-vlm", "--prompts", "2", "--group", "3", "--max-new-tokens",
                 "4", "--lora-rank", "4", "--no-progress", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert [r["backend"] for r in rep["results"]] == ["engine", "trl-generate"]
    for r in rep["results"]:
        assert r["completions"] == 6 and 6 <= r["output_tokens"] <= 24 and r["wall_s"] > 0
    assert rep["ratio_engine_vs_trl_generate"] == rep["results"][1]["wall_s"] / rep["results"][0]["wall_s"]
    assert "| trl-generate |" in capsys.readouterr().out
