"""Module-level reward functions (AReaL runs rewards in a process pool, so they must be picklable).

Signature, as RLVRWorkflow / VisionRLVRWorkflow call them:
``reward(prompt, completions, prompt_ids, completion_ids, **data) -> float``.

Example::

    workflow_kwargs = dict(reward_fn="unsloth_rollout.areal.rewards.geometry3k_reward", ...)

The toy task's reward (``target_token_fraction``) is a test fixture: ``unsloth_rollout.testing.toy``.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")


def _normalize(ans: str) -> str:
    ans = ans.strip().strip("$").replace(" ", "").replace("\\!", "").rstrip(".")
    ans = re.sub(r"\\(?:text|mathrm)\{([^{}]*)\}", r"\1", ans)
    ans = ans.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    ans = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", ans)
    try:
        return repr(round(float(ans), 6))
    except ValueError:
        return ans.lower()


def geometry3k_reward(prompt=None, completions=None, prompt_ids=None, completion_ids=None, answer=None,
                      **data) -> float:
    """1.0 when the last ``\\boxed{...}`` of the completion equals the reference ``answer``, else 0.0.

    Example::

        >>> geometry3k_reward(completions="so x = \\\\boxed{12}", answer="12")
        1.0
    """
    if answer is None or not completions:
        return 0.0
    found = _BOXED.findall(completions)
    if not found:
        return 0.0
    return float(_normalize(found[-1]) == _normalize(str(answer)))
