"""AReaL's own SPMD launchers (local / ray / slurm) with the ``unsloth`` backend registered first.

AReaL's launchers read ``allocation_mode`` to size the job; an unpatched AReaL does not know
``"unsloth:dN"``, so this runs ``install()`` in the launcher process and hands over to the launcher's
``main()``, unchanged. The launcher then starts ``torchrun --nproc-per-node N <script>.py ...`` with
``AREAL_SPMD_MODE=1``: N replicas of one model each (see ``distributed.py``). With AReaL patched by
``patches/areal-1.0.4-unsloth-backend.patch``, ``python -m areal.infra.launcher.local`` works the same.

Usage::

    python -m unsloth_rollout.areal.launch local unsloth_rollout/areal/grpo.py \\
        --config unsloth_rollout/areal/configs/tiny_cpu_grpo.yaml \\
        allocation_mode=unsloth:d2 rollout.backend=unsloth:d2 actor.backend=unsloth:d2
"""

from __future__ import annotations

import importlib
import sys

LAUNCHERS = ("local", "ray", "slurm")
GRPO_SCRIPT = __file__.rsplit("/", 1)[0] + "/grpo.py"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in LAUNCHERS:
        raise SystemExit(f"usage: python -m unsloth_rollout.areal.launch {{{','.join(LAUNCHERS)}}} <train-script.py> "
                         f"--config <yaml> [key=value ...]   (the GRPO script is {GRPO_SCRIPT})")
    kind, rest = argv[0], argv[1:]
    if not rest or not rest[0].endswith(".py"):
        raise SystemExit(f"launch {kind}: the first argument after {kind!r} is the training script "
                         f"(<script>.py, e.g. {GRPO_SCRIPT}); AReaL's launcher runs it under torchrun")
    from unsloth_rollout.areal import install

    if kind == "local":
        from areal.infra.platforms import current_platform

        if not current_platform.device_control_env_var:  # AReaL's local launcher assigns GPUs; none here
            raise SystemExit("launch local: AReaL's local launcher needs GPUs (it sets CUDA_VISIBLE_DEVICES per "
                             "job); on CPU start the N replicas with torchrun: AREAL_SPMD_MODE=1 torchrun "
                             "--nproc-per-node N -m unsloth_rollout.areal.grpo --config ... rollout.backend=unsloth:dN")
    install()
    module = importlib.import_module(f"areal.infra.launcher.{kind}")
    sys.argv = [module.__file__, *rest]
    module.main()


if __name__ == "__main__":
    main()
