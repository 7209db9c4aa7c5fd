"""``python -m unsloth_rollout.bench``: the engine side by side with the usual ways to generate.

Same seeded requests for every backend; reports output and prompt tokens/s, TTFT p50/p99, peak
memory, the engine's speedup, and logprob drift against a teacher-forced forward. See
``python -m unsloth_rollout.bench --help`` and benchmarks/README.md.

Example::

    from unsloth_rollout.bench import run_bench, markdown
    report = run_bench("tiny-lm", prompts=2, group=2, max_new_tokens=8, backends=["engine", "hf-batched"])
    print(markdown(report))
"""

from .backends import BACKENDS
from ..testing.toy import MODELS
from .harness import run_bench
from .report import markdown, plot
from .workloads import WORKLOADS, build_workload

__all__ = ["BACKENDS", "MODELS", "WORKLOADS", "build_workload", "markdown", "plot", "run_bench"]
