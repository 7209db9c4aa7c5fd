"""One thread does the model's work: which thread runs the engine's steps, and that no second thread that ran
torch outlives the work (its OpenMP team would fight the trainer's for the cores).

The oracle for "no extra OpenMP team" is the process's OS thread count (/proc/self/task): a thread that ran a
parallel torch op adds its team's worker threads, and they go away only when it exits. Timing is asserted only
under ``-m slow`` (the ``overhead`` bench on a small model).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams
from unsloth_rollout.engine.worker import WORKER_NAME


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def native_threads() -> int:
    """OS threads of this process that Python did not start (OpenMP's team among them), once the count is steady:
    a Python thread of an earlier test that is exiting (an engine worker leaving when idle) cannot shift it."""
    last = None
    for _ in range(100):
        n = os_threads() - threading.active_count()
        if n == last:
            return n
        last = n
        time.sleep(0.02)
    return last


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WORKER_NAME and t.is_alive()]


def eventually(cond, timeout=30.0) -> bool:
    """Poll ``cond`` (a thread's exit and its team's teardown take a moment); no speed is asserted."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def reqs(policy, n=4, max_new=6, tag="r"):
    return [GenerationRequest(input_ids=policy.tokenizer.encode(f"{tag} counts {i} apples"), request_id=f"{tag}{i}",
                              sampling=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True))
            for i in range(n)]


class StepThreads:
    """Records the thread of every engine step."""

    def __init__(self, core):
        self.fn, self.idents = core.step, []
        core.step = self

    def __call__(self):
        self.idents.append(threading.get_ident())
        return self.fn()


@pytest.fixture
def engine(qwen2_lora_policy):
    torch.ones(1 << 16).sum()  # this thread has an OpenMP team already, as a trainer's would
    eng = RolloutEngine(qwen2_lora_policy, EngineConfig(kv_cache_memory_bytes=16 << 20))
    yield eng
    eng.shutdown()


def test_generate_steps_on_the_calling_thread_and_leaves_no_thread(engine, qwen2_lora_policy):
    steps = StepThreads(engine.core)
    before = os_threads()
    outs = engine.generate(reqs(qwen2_lora_policy))
    assert [len(o.output_ids) for o in outs] == [6] * 4
    assert steps.idents and set(steps.idents) == {threading.get_ident()}
    assert not engine_threads() and engine.driver.workers_started == 0
    assert os_threads() == before


def test_the_worker_exits_when_idle_and_frees_its_team(engine, qwen2_lora_policy):
    steps = StepThreads(engine.core)
    before = os_threads()

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs(qwen2_lora_policy, tag="a")))

    outs = asyncio.run(run())
    assert [len(o.output_ids) for o in outs] == [6] * 4
    assert threading.get_ident() not in steps.idents  # the worker stepped, not the event loop's thread
    assert eventually(lambda: not engine_threads()), "the engine's worker outlived its work"
    assert eventually(lambda: os_threads() <= before), "a thread (or its OpenMP team) outlived the engine's work"
    # On demand again: a second burst starts a fresh worker, which exits too.
    asyncio.run(run())
    assert engine.driver.workers_started >= 2
    assert eventually(lambda: not engine_threads())


needs_team = pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP team to free")


@needs_team
def test_release_thread_team_frees_only_the_calling_threads_team():
    from unsloth_rollout.engine.omp import release_thread_team

    eventually(lambda: not engine_threads(), timeout=10.0)  # an earlier test's worker (and its team) gone
    torch.ones(1 << 16).sum()
    with_team = native_threads()
    assert release_thread_team(), "no OpenMP runtime took omp_pause_resource_all"
    assert native_threads() == with_team - (torch.get_num_threads() - 1)
    torch.ones(1 << 16).sum()  # the next parallel op builds the team again
    assert native_threads() == with_team


@needs_team
def test_while_the_worker_steps_the_submitting_thread_holds_no_team(engine, qwen2_lora_policy):
    """The event loop's thread frees its team when it starts the worker: during the worker's steps the process
    has the worker and one team (its), not two teams on two cores."""
    before = os_threads()  # this thread's team, no worker
    counts = []
    step = engine.core.step

    def counting_step():
        counts.append(os_threads())
        return step()

    engine.core.step = counting_step

    async def run():
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs(qwen2_lora_policy, tag="t")))

    asyncio.run(run())
    assert len(counts) >= 3
    # From the second step the worker's team exists; one extra thread (the worker itself), not a second team.
    assert max(counts[1:]) <= before + 1, (before, counts)


def test_paused_work_holds_no_thread_and_resumes(engine, qwen2_lora_policy):
    engine.pause(holder="trainer")
    futs = [engine.submit(r) for r in reqs(qwen2_lora_policy, tag="p")]
    assert eventually(lambda: not engine_threads()), "a worker waits out the pause instead of exiting"
    assert not any(f.done() for f in futs)
    engine.resume(holder="trainer")
    outs = [f.result(timeout=120)[0] for f in futs]
    assert [len(o.output_ids) for o in outs] == [6] * 4
    assert eventually(lambda: not engine_threads())


def test_generate_takes_over_from_the_worker_and_hands_back(engine, qwen2_lora_policy):
    """A blocking caller arriving while the worker serves async requests drives everyone's steps until its own
    requests are done, then a worker finishes the rest; nothing is lost, greedy outputs match a solo run."""
    solo = {o.request_id: o.output_ids for o in engine.generate(reqs(qwen2_lora_policy, max_new=24, tag="w"))}
    solo.update({o.request_id: o.output_ids for o in engine.generate(reqs(qwen2_lora_policy, n=2, tag="g"))})
    steps = StepThreads(engine.core)
    futs = [engine.submit(r) for r in reqs(qwen2_lora_policy, max_new=24, tag="w")]
    assert eventually(lambda: engine.stats()["decode_tokens"] > 0 and steps.idents)
    mine = engine.generate(reqs(qwen2_lora_policy, n=2, tag="g"))
    assert threading.get_ident() in steps.idents  # the caller stepped
    others = [f.result(timeout=120)[0] for f in futs]
    for o in mine + others:
        assert o.output_ids == solo[o.request_id], o.request_id
    assert len(set(steps.idents)) >= 2
    assert eventually(lambda: not engine_threads())


def test_wait_for_steps_submitted_requests_on_the_waiting_thread(engine, qwen2_lora_policy):
    """Futures from submit(): wait_for() drives their steps here; a resume while it waits starts no worker."""
    engine.pause(holder="trainer")
    futs = [engine.submit(r) for r in reqs(qwen2_lora_policy, tag="f")]
    assert eventually(lambda: not engine_threads())
    steps = StepThreads(engine.core)
    threading.Timer(1.0, engine.resume, kwargs={"holder": "trainer"}).start()  # once wait_for waits
    engine.wait_for(futs, timeout=120)
    assert [len(f.result()[0].output_ids) for f in futs] == [6] * 4
    assert steps.idents and set(steps.idents) == {threading.get_ident()}
    with pytest.raises(TimeoutError):
        engine.pause(holder="trainer")
        engine.wait_for([engine.submit(reqs(qwen2_lora_policy, n=1, tag="t")[0])], timeout=0.2)
    engine.resume(holder="trainer")


def test_abort_while_nobody_steps_applies_now(engine, qwen2_lora_policy):
    engine.pause(holder="user")
    fut = engine.submit(reqs(qwen2_lora_policy, n=1, tag="x")[0])
    engine.abort("x0")
    assert fut.result(timeout=30)[0].finish_reason == "abort"
    engine.resume(holder="user")


@pytest.mark.slow
def test_overhead_ratios_on_a_small_model():
    """Timing (only under -m slow): the engine's steps and a trainer beside it cost what they cost alone, within
    15% (a two-team OpenMP fight costs ~2x: the control of benchmarks/cpu/overhead.md)."""
    from unsloth_rollout.bench.overhead import run_overhead

    report = run_overhead(layers=12, batch=16, steps=8, train_batch=4, train_tokens=64, rounds=3, progress=False)
    for ratio in ("decode_generate_vs_main", "decode_worker_vs_main", "train_after_generate_vs_no_engine",
                  "train_after_agenerate_vs_no_engine"):
        assert report["ratios"][ratio] <= 1.15, report["ratios"]
