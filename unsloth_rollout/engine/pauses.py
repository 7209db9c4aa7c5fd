"""PauseHolders: who holds a pause of the engine, by name; the engine runs only when nobody does.

A user, the server's ``/pause``, AReaL's ``pause_generation``, a trainer and ``offload()`` each hold their own, so
no path resumes a pause somebody else holds. Read and written under the step driver's condition (worker.py).
"""

from __future__ import annotations

from ..errors import InvalidRequestError

PAUSE_MODES = ("keep", "abort", "wait")


class PauseHolders:
    """The names holding a pause, and whether the KV cache is offloaded (which pauses too)."""

    def __init__(self):
        self.holders: set[str] = set()
        self.offloaded = False

    @property
    def paused(self) -> bool:
        return bool(self.holders) or self.offloaded

    @staticmethod
    def check(mode: str, holder: str) -> None:
        """Refuse a pause mode or holder name the engine does not know, naming the field."""
        if mode not in PAUSE_MODES:
            raise InvalidRequestError("mode", f"mode must be 'keep', 'abort' or 'wait', got {mode!r}")
        if not isinstance(holder, str) or not holder:
            raise InvalidRequestError("holder", f"holder must be a non-empty string, got {holder!r}")

    def hold(self, holder: str) -> None:
        self.holders.add(holder)  # a name already held: a no-op (no counting)

    def release(self, holder: str) -> None:
        self.holders.discard(holder)
