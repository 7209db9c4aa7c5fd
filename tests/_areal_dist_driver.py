"""Test driver for tests/test_areal_distributed.py: ``unsloth_rollout.areal.grpo.main`` as the README launches
it (plain python for d1, ``torchrun --nproc-per-node N`` for dN), plus what the tests read back, written under
``$UR_DIST_OUT``: ``pid_rank<r>`` at start, ``step<v>_rank<r>`` after each weight update,
``lora_rank<r>.pt`` (the trainable parameters) and ``history_rank<r>.json`` at the end."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch

torch.set_num_threads(1)
OUT = pathlib.Path(os.environ["UR_DIST_OUT"])
RANK = int(os.environ.get("RANK", "0") or 0)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"pid_rank{RANK}").write_text(str(os.getpid()))
    from areal.trainer.rl_trainer import PPOTrainer

    from unsloth_rollout.areal.grpo import main as grpo_main
    from unsloth_rollout.areal.train_engine import ColocatedTrainEngine

    update = ColocatedTrainEngine.update_weights

    def update_weights(self, meta):
        update(self, meta)
        (OUT / f"step{meta.version}_rank{RANK}").write_text("ok")

    close = PPOTrainer.close

    def close_and_dump(self):
        lora = {n: p.detach().cpu().clone() for n, p in self.actor.policy.model.named_parameters() if p.requires_grad}
        torch.save(lora, OUT / f"lora_rank{RANK}.pt")
        close(self)

    ColocatedTrainEngine.update_weights = update_weights
    PPOTrainer.close = close_and_dump
    history = grpo_main(sys.argv[1:])
    (OUT / f"history_rank{RANK}.json").write_text(json.dumps(history))


if __name__ == "__main__":
    main()
