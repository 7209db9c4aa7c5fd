"""Test driver for tests/test_areal_distributed.py: ``unsloth_rollout.areal.grpo.main`` as the README launches
it (plain python for d1, ``torchrun --nproc-per-node N`` for dN), plus what the tests read back, written under
``$UR_DIST_OUT``: ``pid_rank<r>`` at start, ``step<v>_rank<r>`` after each weight update (and
``lora_step1_rank<r>.pt``, the trainable parameters after the first step), ``stats_step<v>_rank<r>.json``
(the statistics PPOTrainer commits), ``groups_step<v>_rank<r>.json`` (the prompt of each trajectory the rank
trains on), ``lora_rank<r>.pt`` and
``history_rank<r>.json`` at the end."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

import torch

torch.set_num_threads(1)
OUT = pathlib.Path(os.environ["UR_DIST_OUT"])
RANK = int(os.environ.get("RANK", "0") or 0)


def _lora(engine) -> dict:
    return {n: p.detach().cpu().clone() for n, p in engine.policy.model.named_parameters() if p.requires_grad}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"pid_rank{RANK}").write_text(str(os.getpid()))
    from areal.trainer.rl_trainer import PPOTrainer

    from unsloth_rollout.areal.grpo import main as grpo_main
    from unsloth_rollout.areal.train_engine import ColocatedTrainEngine

    update = ColocatedTrainEngine.update_weights

    def update_weights(self, meta):
        update(self, meta)
        if meta.version == 1:
            torch.save(_lora(self), OUT / f"lora_step1_rank{RANK}.pt")
        (OUT / f"step{meta.version}_rank{RANK}").write_text("ok")

    close = PPOTrainer.close

    def close_and_dump(self):
        torch.save(_lora(self.actor), OUT / f"lora_rank{RANK}.pt")
        close(self)

    from areal.utils.stats_logger import StatsLogger

    commit = StatsLogger.commit

    def commit_and_dump(self, epoch, step, global_step, data):
        (OUT / f"stats_step{global_step + 1}_rank{RANK}.json").write_text(json.dumps(data))
        return commit(self, epoch, step, global_step, data)

    StatsLogger.commit = commit_and_dump
    from unsloth_rollout.areal.train_engine import UnslothPPOActor

    advantages = UnslothPPOActor.compute_advantages

    def compute_advantages(self, data, *args, **kwargs):
        # Which prompts this rank trains on, and how its trajectories group the samples.
        groups = []
        for traj in data:
            prompt = traj["attention_mask"].bool() & (traj["loss_mask"] == 0)
            ids = {hashlib.sha1(str(row[m].tolist()).encode()).hexdigest()[:16]
                   for row, m in zip(traj["input_ids"], prompt)}
            groups.append({"rows": int(traj["input_ids"].shape[0]), "prompts": sorted(ids)})
        (OUT / f"groups_step{self.get_version() + 1}_rank{RANK}.json").write_text(json.dumps(groups))
        return advantages(self, data, *args, **kwargs)

    UnslothPPOActor.compute_advantages = compute_advantages
    ColocatedTrainEngine.update_weights = update_weights
    PPOTrainer.close = close_and_dump
    history = grpo_main(sys.argv[1:])
    (OUT / f"history_rank{RANK}.json").write_text(json.dumps(history))


if __name__ == "__main__":
    main()
