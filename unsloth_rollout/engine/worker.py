"""StepDriver: which thread runs ``EngineCore.step()`` — one at a time, and never a second one idling.

On CPU every OS thread that runs a parallel torch op gets its own OpenMP thread team, and two teams in one
process fight for the same cores even while one of them sleeps (libgomp stops spinning and sleeps on a futex
once it manages more threads than there are CPUs; measured: a blocked thread that once ran a forward made the
main thread's forwards 4.4x slower). A thread's team is freed only when the thread exits. So:

- a caller that waits for its results (``RolloutEngine.generate``) runs the steps itself, on its own thread,
  which already has a team (it loaded the model, it trains), batching everyone else's requests too;
- requests nobody waits for on a thread (``agenerate``, ``stream``, the server) are stepped by a worker
  thread that exits as soon as nothing can run (idle, or paused), so its team is freed before the trainer's
  next step, and is started again on demand; it also steps aside (exits) when a caller comes to drive.
  The thread that starts a worker frees its own team first (``omp.release_thread_team``): it is about to wait.

Exactly one thread owns the drive at a time (``owner``); ``step_lock`` is held for each step, whoever runs it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import torch

from ..logs import get_logger
from ..errors import ModelNotServableError
from .inbox import Inbox
from .omp import release_thread_team
from .pauses import PauseHolders
from .precision import model_precision

logger = get_logger("unsloth_rollout")

WORKER_NAME = "unsloth-rollout-engine"
_FAILED_STEP_BACKOFF_S = 0.05  # after a failed step, instead of spinning on it


class StepDriver:
    """Who steps the core, over the engine's inbox (new sequences, aborts) and its pause holders.

    A step that raises ModelNotServableError makes the inbox refuse everything (``Inbox.refuse``).
    """

    def __init__(self, core):
        self.core = core
        self.cond = threading.Condition()
        self.step_lock = threading.Lock()  # held by the owner for each step
        self.inbox = Inbox(self.cond, core.output.delta)
        self.pauses = PauseHolders()  # paused while anyone holds a pause (or the KV cache is offloaded)
        self.stopped = False
        self.owner: threading.Thread | None = None  # the thread holding the drive (worker or caller)
        self.worker: threading.Thread | None = None  # the last worker started (for join on shutdown)
        self._callers = 0  # threads waiting in drive_until: a worker hands the drive to them
        self.workers_started = 0

    # ------------------------------------------------------------------ state (call under cond)
    @property
    def paused(self) -> bool:
        return self.pauses.paused

    def _runnable(self) -> bool:
        """A step can run now."""
        return not self.stopped and not self.paused and bool(self.inbox.queued or self.core.scheduler.has_work())

    def _chores(self) -> bool:
        """Aborts to apply, or (while paused) submissions to hand to the core."""
        return not self.stopped and bool(self.inbox.abort_ids or (self.inbox.queued and self.paused))

    # ------------------------------------------------------------------ one unit of work
    def drain_inbox(self) -> None:
        """Hand new sequences to the core and apply aborts (call holding step_lock)."""
        new, aborts = self.inbox.take()
        for s in new:
            self.core.add(s)
        if aborts:
            for s in [s for s in self.core.sequences() if s.request_id in aborts]:
                self.core.finish(s, "abort")

    def step(self) -> int:
        """Take in new requests and aborts, then run one core step (call holding step_lock)."""
        self.drain_inbox()
        try:
            with model_precision(self.core.policy):  # the model's own dtype, whatever autocast is on (precision.py)
                return self.core.step()
        except ModelNotServableError as e:
            self.inbox.refuse(e, self.core)
            return 0

    def _work_once(self) -> bool:
        """Run one step, or the chores a pause allows; False when there was nothing to do."""
        with self.step_lock:
            with self.cond:
                runnable, chores = self._runnable(), self._chores()
            if runnable:
                try:
                    self.step()
                    return True
                except Exception:  # the engine must keep serving; the step already failed its sequences
                    logger.exception("unsloth_rollout: engine step failed")
                with self.cond:
                    self.cond.wait(timeout=_FAILED_STEP_BACKOFF_S)
                return True
            if chores:
                self.drain_inbox()
                return True
        return False

    # ------------------------------------------------------------------ the worker thread
    def kick(self) -> None:
        """Make sure someone will step: start a worker if there is work and nobody holds or wants the drive."""
        with self.cond:
            self.cond.notify_all()
            if self.owner is not None or self._callers or not (self._runnable() or self._chores()):
                return
            t = threading.Thread(target=self._worker_loop, name=WORKER_NAME, daemon=True)
            self.owner = self.worker = t
            self.workers_started += 1
        # This thread now waits (or serves HTTP) while the worker runs the model: free its OpenMP team, or
        # the two teams oversubscribe the cores and every op of the worker's steps pays a futex wake-up.
        release_thread_team()
        t.start()

    def _worker_loop(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self.cond:
                    # Exit when idle, paused or asked to: the thread's OpenMP team goes with it. The drive is
                    # released in the same critical section, so a submit that finds no driver starts a new one.
                    if self._callers or not (self._runnable() or self._chores()):
                        self.owner = None
                        self.cond.notify_all()
                        return
                self._work_once()
        finally:
            with self.cond:
                if self.owner is me:
                    self.owner = None
                    self.cond.notify_all()

    # ------------------------------------------------------------------ a caller drives
    def drive_until(self, futures: list[concurrent.futures.Future], timeout: float | None = None) -> None:
        """Run steps on the calling thread until every future is done (another caller may drive meanwhile:
        then this one waits). Raises TimeoutError after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.current_thread()
        done = lambda: all(f.done() for f in futures)  # noqa: E731
        with self.cond:
            self._callers += 1
            self.cond.notify_all()
        try:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"requests not finished after {timeout} s (they stay in flight)")
                with self.cond:
                    if self.owner is None and not self.stopped:
                        self.owner = me
                    elif self.owner is not me:  # the worker steps aside at its next boundary
                        self.cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
                        continue
                if not self._work_once():
                    with self.cond:  # paused or waiting for others' work: woken by resume / submit / finish
                        if not done() and not (self._runnable() or self._chores()):
                            self.cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        finally:
            with self.cond:
                self._callers -= 1
                if self.owner is me:
                    self.owner = None
                self.cond.notify_all()
            self.kick()  # requests of others still running: hand them to a worker (or the next caller)

    # ------------------------------------------------------------------ between steps (any thread)
    def hold(self, holder: str) -> None:
        """Pause under ``holder``'s name; returns once the step in progress (if any) has ended."""
        with self.cond:
            self.pauses.hold(holder)
        with self.step_lock:  # wait for the step in progress to end
            pass

    def release(self, holder: str) -> None:
        with self.cond:
            self.pauses.release(holder)
        self.kick()  # sequences in flight: the worker exited while paused

    def abort(self, request_ids) -> None:
        """Abort these requests: here when nobody is stepping (or paused), else at the next step boundary."""
        with self.cond:
            self.inbox.abort(request_ids)
            applied_now = self.paused or self.owner is None
        if applied_now:
            with self.step_lock:
                self.drain_inbox()

    def abort_all(self) -> None:
        with self.cond:
            self.inbox.abort(list(self.inbox.pending))
        with self.step_lock:
            self.drain_inbox()

    def abort_adapter(self, name: str, error: str) -> None:
        """Finish every sequence under adapter ``name``, queued ones too (call holding step_lock): a step between
        an unload and a reload would prefill them under an adapter that no longer exists (the differential test)."""
        self.drain_inbox()
        for s in self.core.sequences():
            if s.lora_name == name:
                self.core.finish(s, "abort", error=error)

    def weights_changed(self) -> None:
        """After a ``WeightsClock.bump``: apply the stale-KV rule now when no step runs, else the next step does."""
        with self.cond:
            self.cond.notify_all()
        if self.step_lock.acquire(blocking=False):
            try:
                self.core.apply_weight_changes(*self.core.weights.state()[1:])
            finally:
                self.step_lock.release()

    def offload(self) -> None:
        """Preempt everything, drop the prefix cache and free the KV storage (the caller holds a pause)."""
        sch, kv = self.core.scheduler, self.core.kv
        with self.step_lock:
            for s in list(sch.running):
                sch.preempt(s)
            sch.prefix.drop()
            kv.release_storage()
            self.pauses.offloaded = True
            if kv.device.type == "cuda":
                torch.cuda.empty_cache()

    def onload(self) -> None:
        with self.step_lock:
            self.core.kv.allocate_storage()
            self.pauses.offloaded = False

    # ------------------------------------------------------------------ stop
    def stop(self, join: bool = True) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
            worker = self.worker
        if join and worker is not None and worker is not threading.current_thread():
            worker.join(timeout=30)
