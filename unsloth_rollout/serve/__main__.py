"""``python -m unsloth_rollout.serve MODEL [options]``: see ``unsloth_rollout.serve.cli``."""

from .cli import main

if __name__ == "__main__":
    main()
