"""Moved to ``unsloth_rollout.testing.tiny`` (test fixtures do not belong to the runtime models package).

Kept as an alias so older scripts and ``python -m unsloth_rollout.models.tiny`` keep working.
"""

import sys as _sys

from ..testing import tiny as _tiny

if __name__ == "__main__":
    _tiny.main()
else:
    _sys.modules[__name__] = _tiny
