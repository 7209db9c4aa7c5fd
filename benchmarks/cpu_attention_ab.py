"""A/B of the CPU decode attention kernel inside a real decode step, in one process: the 36-layer bench model
(``python -m unsloth_rollout.bench.captured``'s: tiny-lm config at 36 layers, LoRA r=8, batch 64, contexts from
256), the engine built once, the kernel switched on and off every round (8 rounds of 6 timed steps each); prints
the median step of each, in ms:

    PYTHONPATH=$PWD python benchmarks/cpu_attention_ab.py compiled    # the compiled step
    PYTHONPATH=$PWD python benchmarks/cpu_attention_ab.py workspace   # the eager default
"""

import statistics
import sys
import time

from unsloth_rollout.bench.long import setup
from unsloth_rollout.bench.overhead import deep_policy


def _kernel(core, on: bool) -> None:
    core.runner.kernel = core.runner.decode_steps.context.kernel = on  # read by the eager and the compiled step


def main(backend: str = "compiled") -> None:
    policy = deep_policy("tiny-lm", 36, 8, 0)
    core = setup(policy, backend, 256, 64, 300, 0)
    for k in (False, True):  # the compiled step compiles once per setting
        _kernel(core, k)
        for _ in range(2):
            core.step()
    res = {True: [], False: []}
    for _ in range(8):
        for k in (False, True):
            _kernel(core, k)
            core.step()
            ts = []
            for _ in range(6):
                t = time.perf_counter()
                core.step()
                ts.append(time.perf_counter() - t)
            res[k].append(1000 * statistics.median(ts))
    print(f"{backend}: kernel off {statistics.median(res[False]):.2f} ms, on {statistics.median(res[True]):.2f} ms; "
          f"rounds off {[round(x, 1) for x in res[False]]} on {[round(x, 1) for x in res[True]]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
