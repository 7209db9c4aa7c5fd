"""The AReaL path of the real-weights GRPO run: ``PPOTrainer`` with ``rollout.backend: "unsloth:d1"``.

It runs ``unsloth_rollout.areal.grpo.main`` on ``configs/smollm2_capitals_cpu_grpo.yaml`` with the shared
settings as overrides. The logprob check compares, for every trajectory, the engine's behaviour logprobs
(``logprobs``, aligned with ``input_ids``) with the actor's recomputed ones (``compute_logp``, the
``prox_logp`` AReaL's decoupled loss uses; shifted by one: entry t scores token t+1) on the loss-masked tokens.
Generation time is AReaL's ``timeperf/rollout``, training time the step's other timed phases.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from collections.abc import Callable

from .checks import RowCheck, hf_generate_forced_rows, row_check, spread, teacher_forced_rows, with_widest
from .settings import RunSettings, StepRecord, num_layers, resolve_model

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "areal" / "configs" / "smollm2_capitals_cpu_grpo.yaml"
REWARD_KEY = "ppo_actor/task_reward/avg"
ROLLOUT_KEY = "timeperf/rollout"


def areal_overrides(s: RunSettings, fileroot: str) -> list[str]:
    """``key=value`` overrides that give AReaL's config the shared settings."""
    targets = s.lora_targets(num_layers(resolve_model(s.model)))
    lora = [f"++actor.target_modules=[{','.join(targets)}]"] if targets else []
    return [*lora, f"actor.path={s.model}", f"total_train_steps={s.steps}", f"seed={s.seed}",
            f"unsloth.random_state={s.seed}", f"train_dataset.batch_size={s.prompts_per_step}",
            f"train_dataset.dataset_kwargs.n={s.rows}", f"train_dataset.dataset_kwargs.seed={s.seed}",
            f"gconfig.n_samples={s.group}", f"gconfig.max_new_tokens={s.max_new_tokens}",
            f"gconfig.temperature={s.temperature}", f"actor.optimizer.lr={s.lr}", f"actor.lora_rank={s.lora_r}",
            f"actor.lora_alpha={s.lora_alpha}", f"cluster.fileroot={fileroot}/exp",
            f"cluster.name_resolve.nfs_record_root={fileroot}/nr"]


def behaviour_logprob_gap(batch, recomputed) -> float:
    """max |behaviour logprob - recomputed logprob| over the loss-masked (sampled) tokens of ``batch``."""
    import torch

    worst = 0.0
    for traj, lp in zip(batch, recomputed):
        behave = torch.roll(traj["logprobs"].float(), shifts=-1, dims=-1)
        mask = torch.roll(traj["loss_mask"].bool(), shifts=-1, dims=-1)
        mask[..., -1] = False
        if mask.any():
            worst = max(worst, (behave - lp.float().to(behave.device)).abs()[mask].max().item())
    return worst


def behaviour_samples(batch, recomputed=None) -> list[tuple]:
    """(prompt_ids, output_ids, behaviour logprobs) of every row of ``batch`` (AReaL trajectories), and with
    ``recomputed`` (compute_logp's output: entry t scores token t+1) the trainer's logprobs of the same tokens."""
    out = []
    for i, traj in enumerate(batch):
        ids, mask, lp = traj["input_ids"], traj["loss_mask"], traj["logprobs"]
        attn = traj.get("attention_mask")
        re = None if recomputed is None else recomputed[i].detach().float().cpu()
        if ids.dim() == 1:
            ids, mask, lp = ids[None], mask[None], lp[None]
            attn = None if attn is None else attn[None]
            re = None if re is None else re[None]
        for r in range(ids.shape[0]):
            n = int(attn[r].sum()) if attn is not None else ids.shape[1]
            sampled = mask[r, :n].bool().nonzero().flatten().tolist()
            if not sampled:
                continue
            start = sampled[0]
            row = (ids[r, :start].tolist(), ids[r, start:n].tolist(), lp[r, start:n].tolist())
            out.append(row if re is None else (*row, re[r, start - 1:n - 1].tolist()))
    return out


def _versions(batch) -> list[int]:
    out: set[int] = set()
    for traj in batch:
        v = traj.get("versions")
        if v is not None:
            out.update(int(x) for x in v[traj["loss_mask"].bool()].tolist())
    return sorted(out)


def run_areal(s: RunSettings, on_step: Callable[[str, StepRecord], None] | None = None,
              extra_overrides: list[str] | None = None) -> list[StepRecord]:
    """Train ``s.steps`` GRPO steps with AReaL's PPOTrainer on the colocated engine."""
    if s.bitwise:
        raise ValueError("--bitwise 1 runs the trl-engine path only (the AReaL path loads its model from its config)")
    import torch

    from ...areal.grpo import main

    if s.threads:
        torch.set_num_threads(s.threads)
    gaps: list[float] = []
    checks: list[RowCheck] = []
    checked_rows: list[int] = []
    check_times: list[float] = []
    versions: list[list[int]] = []
    lengths: list[float] = []
    records: list[StepRecord] = []

    def setup(trainer, history):
        compute_logp = trainer.actor.compute_logp

        def checked_compute_logp(batch, *args, **kwargs):
            out = compute_logp(batch, *args, **kwargs)
            gaps.append(behaviour_logprob_gap(batch, out))
            t0 = time.perf_counter()  # the oracle, on the weights that sampled (before this step's update)
            rows = behaviour_samples(batch, out)
            checked = with_widest(spread(rows, s.oracle_samples), rows, [x[2] for x in rows], [x[3] for x in rows])
            oracle = teacher_forced_rows(trainer.actor.policy, checked, s.temperature)
            hf_lp = hf_generate_forced_rows(trainer.actor.policy, checked, s.temperature)
            checks.append(row_check([x[2] for x in checked], [x[3] for x in checked], oracle, hf_lp))
            checked_rows.append(len(checked))
            check_times.append(time.perf_counter() - t0)
            versions.append(_versions(batch))
            n = sum(int(t["loss_mask"].shape[0]) if t["loss_mask"].dim() > 1 else 1 for t in batch)
            lengths.append(sum(int(t["loss_mask"].sum()) for t in batch) / max(1, n))
            return out

        trainer.actor.compute_logp = checked_compute_logp
        commit = trainer.stats_logger.commit

        def commit_and_record(epoch, step, global_step, data):
            res = commit(epoch, step, global_step, data)
            stats = (data if isinstance(data, list) else [data])[0]
            i = len(records)
            gen = float(stats.get(ROLLOUT_KEY, float("nan")))
            check = check_times[i] if i < len(check_times) else 0.0
            chk = checks[i] if i < len(checks) else RowCheck()
            train = sum(float(v) for k, v in stats.items()
                        if k.startswith("timeperf/") and k != ROLLOUT_KEY and "/" not in k[len("timeperf/"):]) - check
            rec = StepRecord(step=i + 1, mean_reward=float(stats[REWARD_KEY]), generation_s=gen, train_s=train,
                             logprob_diff_max=gaps[i] if i < len(gaps) else None,
                             oracle_diff_max=chk.oracle, trainer_drift_max=chk.drift, checked_diff_max=chk.trainer,
                             hf_forced_diff_max=chk.hf,
                             checked_rows=checked_rows[i] if i < len(checked_rows) else 0, check_s=check,
                             completion_tokens_mean=lengths[i] if i < len(lengths) else None,
                             versions=versions[i] if i < len(versions) else [])
            records.append(rec)
            if on_step is not None:
                on_step("areal-engine", rec)
            return res

        trainer.stats_logger.commit = commit_and_record

    root = tempfile.mkdtemp(prefix="unsloth_rollout_real_areal_")
    main(["--config", str(CONFIG), *areal_overrides(s, root), *(extra_overrides or [])], setup=setup)
    return records
