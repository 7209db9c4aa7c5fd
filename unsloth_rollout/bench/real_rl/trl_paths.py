"""The two TRL paths of the real-weights GRPO run: GRPOTrainer with its own generate, and with the engine.

Both load the same checkpoint with the same seeded LoRA, feed the same prompts in the same order (no
shuffling), and differ only in ``rollout_func``. Generation time is the wall time of the trainer's
``_generate(prompts)`` call (tokenization, generation, decoding: what GRPOTrainer does per step either way),
training time the rest of the optimizer step.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable

from .checks import (HFGenerateLogprobs, RowCheck, TrainerLogprobs, hf_generate_forced_rows, match_rows, row_check,
                     spread, teacher_forced_rows, with_widest)
from .settings import RunSettings, StepRecord, num_layers, resolve_model
from .task import capital_rows, trl_capital_reward, trl_dataset

LOGP_KEY = "sampling/sampling_logp_difference/max"


def grpo_args(s: RunSettings, output_dir: str):
    """The GRPOConfig both TRL paths train with (a float32 trainer: its recompute is what the logprob checks hold
    each path's sampled tokens to)."""
    from ...testing.trl_toy import grpo_config

    return grpo_config(output_dir, s.steps, lr=s.lr, num_generations=s.group, prompts_per_step=s.prompts_per_step,
                       max_completion_length=s.max_new_tokens, seed=s.seed, temperature=s.temperature,
                       shuffle_dataset=False, loss_type="dapo", epsilon=0.2, scale_rewards="group", bf16=False)


def load_policy(s: RunSettings):
    import torch

    from ...models import load_model

    path = resolve_model(s.model)
    lora = {"r": s.lora_r, "lora_alpha": s.lora_alpha, "random_state": s.seed}
    targets = s.lora_targets(num_layers(path))
    if targets is not None:
        lora["target_modules"] = targets
    torch.manual_seed(s.seed)
    policy = load_model(path, backend="transformers", dtype=torch.float32, lora=lora)
    if s.bitwise:
        from ... import bitwise

        bitwise.enable(policy)
    return policy


class _StepTimer:
    """A TrainerCallback recording each optimizer step's wall time, reward and TRL's logprob check."""

    def __init__(self, name: str, s: RunSettings, rf=None, on_step: Callable[[str, StepRecord], None] | None = None):
        from transformers import TrainerCallback

        self.name, self.s, self.rf, self.on_step = name, s, rf, on_step
        self.gen_times: list[float] = []
        self.comp_lens: list[float] = []
        self.check_times: list[float] = []
        self.checks: list[RowCheck] = []  # per step, on the checked rows (checks.py)
        self.all_rows_gap: list[float | None] = []  # per step: max |behaviour - trainer| over every row
        self.checked_rows: list[int] = []
        self.records: list[StepRecord] = []
        self._t0 = 0.0
        self._wall: list[float] = []
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                timer._wall.append(time.perf_counter() - timer._t0)

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "reward" in logs:
                    timer._record(state.global_step, logs)

        self.callback = Callback()

    def _record(self, step: int, logs: dict) -> None:
        i = len(self.records)
        gen = self.gen_times[i] if i < len(self.gen_times) else float("nan")
        wall = self._wall[i] if i < len(self._wall) else float("nan")
        check = self.check_times[i] if i < len(self.check_times) else 0.0
        diff = logs.get(LOGP_KEY)  # TRL's own check on the engine path; TRL's own generate path has none
        if diff is None and i < len(self.all_rows_gap):
            diff = self.all_rows_gap[i]
        chk = self.checks[i] if i < len(self.checks) else RowCheck()
        versions = self.rf.history[i]["versions"] if self.rf is not None and i < len(self.rf.history) else []
        rec = StepRecord(step=step, mean_reward=float(logs["reward"]), generation_s=gen, train_s=wall - gen - check,
                         logprob_diff_max=None if diff is None else float(diff),
                         oracle_diff_max=chk.oracle, trainer_drift_max=chk.drift, checked_diff_max=chk.trainer,
                         hf_forced_diff_max=chk.hf,
                         checked_rows=self.checked_rows[i] if i < len(self.checked_rows) else 0, check_s=check,
                         completion_tokens_mean=self.comp_lens[i] if i < len(self.comp_lens) else None,
                         versions=list(versions))
        self.records.append(rec)
        if self.on_step is not None:
            self.on_step(self.name, rec)


def run_trl(s: RunSettings, engine_path: bool, on_step=None, engine_config=None) -> list[StepRecord]:
    """Train ``s.steps`` GRPO steps with TRL's GRPOTrainer; ``engine_path``: generate through the engine."""
    import torch
    from trl import GRPOTrainer

    from ...engine import EngineConfig, RolloutEngine
    from ...trl import rollout_func

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if s.threads:
        torch.set_num_threads(s.threads)
    if s.bitwise and not engine_path:
        raise ValueError("--bitwise 1 runs the trl-engine path only (TRL's own generate has no engine)")
    policy = load_policy(s)
    engine = rf = None
    if engine_path:
        cfg = engine_config or EngineConfig(kv_cache_memory_bytes=256 << 20, max_model_len=512)
        engine = RolloutEngine(policy, cfg, seed=s.seed)
        rf = rollout_func(engine)
    name = "trl-engine" if engine_path else "trl-generate"
    timer = _StepTimer(name, s, rf, on_step)
    out_dir = tempfile.mkdtemp(prefix=f"unsloth_rollout_real_{name}_")
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer, reward_funcs=trl_capital_reward,
                          args=grpo_args(s, out_dir), train_dataset=trl_dataset(capital_rows(s.rows, s.seed)),
                          rollout_func=rf, callbacks=[timer.callback])
    hf = None if engine_path else HFGenerateLogprobs(policy.model, s.temperature)
    pending: dict = {}

    def on_trainer_rows(rows):
        # the trainer's recompute of this step's rows, still before its optimizer update
        samples, checked, oracle = pending.pop("samples"), pending.pop("checked"), pending.pop("oracle")
        trainer_lp = match_rows(samples, rows)
        timer.all_rows_gap.append(row_check([x[2] for x in samples], trainer_lp, trainer_lp).trainer)
        t0 = time.perf_counter()
        extra = with_widest(checked, samples, [x[2] for x in samples], trainer_lp)[len(checked):]
        oracle = oracle + teacher_forced_rows(policy, extra, s.temperature)
        checked = checked + extra
        # HF generate's own logprobs of the same tokens: on TRL's own generate path they are the behaviour ones
        # (HF generate sampled these tokens), so only the engine path forces them through HF generate
        hf_lp = hf_generate_forced_rows(policy, checked, s.temperature) if engine_path else [x[2] for x in checked]
        timer.check_times[-1] += time.perf_counter() - t0
        timer.checked_rows[-1] = len(checked)
        by_row = dict(zip(map(id, samples), trainer_lp))
        timer.checks.append(row_check([x[2] for x in checked], [by_row[id(x)] for x in checked], oracle, hf_lp))

    recompute = TrainerLogprobs(trainer, grad=not engine_path, on_rows=on_trainer_rows)
    generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        res = generate(prompts)
        timer.gen_times.append(time.perf_counter() - t0)
        completion_ids = res[1]
        timer.comp_lens.append(sum(len(c) for c in completion_ids) / max(1, len(completion_ids)))
        # The oracle runs before this step's optimizer update, on the weights that sampled.
        t1 = time.perf_counter()
        if engine_path:
            samples = [(list(o.prompt_ids), list(o.output_ids), list(o.output_logprobs)) for o in rf.last_outputs]
        else:
            samples = [(list(p), new[:len(c)], lp[:len(c)]) for (p, new, lp), c in zip(hf.rows, completion_ids)]
        checked = spread(samples, s.oracle_samples)
        pending.update(samples=samples, checked=checked, oracle=teacher_forced_rows(policy, checked, s.temperature))
        timer.checked_rows.append(len(checked))
        recompute.armed = True
        timer.check_times.append(time.perf_counter() - t1)
        return res

    trainer._generate = timed_generate
    try:
        trainer.train()
    finally:
        if engine is not None:
            engine.shutdown()
    return timer.records


def progress_line(name: str, rec: StepRecord, steps: int) -> None:
    def fmt(x):
        return "-" if x is None else f"{x:.1e}"

    print(f"[{name}] step {rec.step}/{steps}  reward {rec.mean_reward:.3f}  generation {rec.generation_s:.1f} s  "
          f"train {rec.train_s:.1f} s  max|dlogp| vs trainer {fmt(rec.logprob_diff_max)}, vs teacher-forced "
          f"{fmt(rec.oracle_diff_max)} (HF generate on the same tokens {fmt(rec.hf_forced_diff_max)})",
          file=sys.stderr, flush=True)
