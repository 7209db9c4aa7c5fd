"""Decode-step profile: is the KV history copied per step, how does decode cost grow with context, and what
share of a full-batch step is sampling + bookkeeping.

The measurement is the bench's ``--workload long`` (unsloth_rollout/bench/long.py, where the method is
described); this script runs it with the profile's defaults and writes the same JSON:

    PYTHONPATH=$PWD python benchmarks/profile_decode.py --json benchmarks/cpu/long.json
    # = python -m unsloth_rollout.bench --workload long --batch 32 --contexts 256,2048 --steps 16 \\
    #       --backends workspace,gather --json benchmarks/cpu/long.json

The machine may be shared: compare within one run, as ratios (the JSON records the load it saw).
"""

from __future__ import annotations

import sys

from unsloth_rollout.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["--workload", "long", *sys.argv[1:]]))
