"""``rollout.backend: "unsloth:dN"``: N colocated data-parallel replicas started by torchrun (AReaL's SPMD mode), on
CPU with gloo. Oracle: the same config as ONE process (``unsloth:d1``) over the same global batch. The replicas
run ``tests/_areal_dist_driver.py`` = ``unsloth_rollout.areal.grpo.main`` plus dumps of what the tests compare."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("areal")
pytestmark = pytest.mark.areal

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "unsloth_rollout" / "areal" / "configs" / "tiny_cpu_grpo.yaml"
DRIVER = ROOT / "tests" / "_areal_dist_driver.py"
# Deterministic rollouts (greedy) and one mini-batch, so one process and two replicas see the same samples and
# take one optimizer step over the same global batch. Batch-level reward normalisation is the statistic that
# would differ if it were computed per rank (AReaL all-reduces it); with greedy samples, group-level would be 0.
# SGD without clipping: Adam's first step is lr * g / (|g| + eps), which turns float noise on near-zero gradient
# entries into lr-sized differences, and clipping to norm 1 would hide a wrong gradient scale; plain SGD keeps the
# comparison on the gradients, the thing data parallelism changes.
EXACT = ("gconfig.greedy=true", "gconfig.n_samples=2", "actor.reward_norm.mean_level=batch",
         "actor.reward_norm.std_level=batch", "actor.optimizer.type=sgd", "actor.optimizer.gradient_clipping=1e9",
         "train_dataset.dataset_kwargs.n=4")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(out: pathlib.Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               UR_DIST_OUT=str(out), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AREAL_SPMD_MODE"):
        env.pop(k, None)
    return env


def _args(out: pathlib.Path, *overrides) -> list[str]:
    return ["--config", str(CONFIG), f"cluster.fileroot={out}/exp", f"cluster.name_resolve.nfs_record_root={out}/nr",
            *overrides]


def _torchrun(nproc: int, target: list[str]) -> list[str]:
    # `torchrun` is `python -m torch.distributed.run`
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
            "127.0.0.1", "--master-port", str(_free_port()), *target]


def _run(cmd, out, timeout):
    out.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(cmd, cwd=ROOT, env=_env(out), capture_output=True, text=True, timeout=timeout)
    return run, run.stdout[-4000:] + run.stderr[-6000:]


def _lora(out, rank):
    import torch

    return torch.load(out / f"lora_rank{rank}.pt")


def _start(cmd, out):
    out.mkdir(parents=True, exist_ok=True)
    log = out / "torchrun.log"
    with open(log, "w") as sink:  # a file, not a pipe: the stats tables would fill a pipe and block the job
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(out), stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def _wait_for(paths, proc, log, timeout):
    deadline = time.time() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, log.read_text()[-5000:]
        assert time.time() < deadline, f"never saw {paths}"
        time.sleep(0.5)


def test_two_replicas_match_one_process_then_a_killed_replica_fails_the_job_fast(tmp_path):
    """One torchrun job (two replicas, the README's launch) for both checks, to keep CI short:
    after step 1 the LoRA weights equal one process's over the same global batch; then rank 1 is killed
    while the job runs on, and the job must stop within a minute with an error naming it."""
    import torch

    one, two = tmp_path / "d1", tmp_path / "d2"
    run1, log1 = _run([sys.executable, str(DRIVER), *_args(one, "total_train_steps=1", *EXACT)], one, 600)
    assert run1.returncode == 0, log1
    proc, log = _start(_torchrun(2, [str(DRIVER), *_args(two, "rollout.backend=unsloth:d2", "total_train_steps=1000",
                                                          *EXACT)]), two)
    try:
        _wait_for([two / "step2_rank0", two / "step2_rank1"], proc, log, 420)
        # --- the replicas after step 1 vs one process
        ref, r0, r1 = (torch.load(d / f"lora_step1_rank{r}.pt") for d, r in ((one, 0), (two, 0), (two, 1)))
        assert set(ref) == set(r0) == set(r1) and any("visual" in k for k in ref)  # vision-tower LoRA included
        for k in ref:
            assert torch.equal(r0[k], r1[k]), k  # the replicas hold bit-identical LoRA weights
            assert torch.allclose(r0[k], ref[k], atol=1e-6, rtol=0), (k, (r0[k] - ref[k]).abs().max())
        moved = max(ref[k].abs().max().item() for k in ref if "lora_B" in k)  # LoRA B starts at 0
        diff = max((r0[k] - ref[k]).abs().max().item() for k in ref)
        print(f"one step: largest LoRA-B change {moved:.3e}, largest |2 replicas - 1 process| {diff:.3e}")
        assert moved > 1e-3, "the step barely changed the LoRA weights: the 1e-6 comparison would be vacuous"
        # AReaL's sampler split the same global batch: 2 + 2 of the one process's 4 prompts, each prompt's
        # n_samples group whole on one rank (so group-level normalisation never needs the other rank).
        g1, g2 = (json.loads((one / "groups_step1_rank0.json").read_text()),
                  [json.loads((two / f"groups_step1_rank{r}.json").read_text()) for r in (0, 1)])
        for groups in (g1, *g2):
            assert all(g["rows"] == 2 and len(g["prompts"]) == 1 for g in groups), groups
        p0, p1 = ({g["prompts"][0] for g in groups} for groups in g2)
        assert len(p0) == len(p1) == 2 and not p0 & p1 and p0 | p1 == {g["prompts"][0] for g in g1}
        # --- kill one replica mid-run
        os.kill(int((two / "pid_rank1").read_text()), signal.SIGKILL)
        t0 = time.time()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("the job hung after one replica was killed")
        elapsed = time.time() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # AReaL's reward process pool forks workers into each replica's process group; the killed replica's
        # worker outlives it, blocked on its own task queue (seen in CI, asleep for an hour): none may stay
        for pid_file in two.glob("pid_rank*"):
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass
    output = log.read_text()
    assert proc.returncode != 0
    assert elapsed < 60, elapsed
    # torchrun stops the other replica and names the dead one; a survivor that reaches a collective first
    # raises ReplicaLostError.
    assert re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", output) or "ReplicaLostError" in output, output[-5000:]
    assert not (two / "history_rank0.json").exists()
    # One global step: the statistics are averaged over the replicas and equal the one-process ones.
    h1 = json.loads((one / "stats_step1_rank0.json").read_text())
    h2 = [json.loads((two / f"stats_step1_rank{r}.json").read_text()) for r in (0, 1)]
    assert h1["ppo_actor/n_seqs"] == 4 * 2  # the global batch: 4 prompts x 2 samples (split 2 + 2 over replicas)
    for key in ("ppo_actor/n_seqs", "ppo_actor/task_reward/avg", "ppo_actor/update/grad_norm"):
        assert h2[0][key] == h2[1][key] == pytest.approx(h1[key], rel=1e-5, abs=1e-7), key


_DEAD_PEER = textwrap.dedent("""
    import os, sys, time, torch
    torch.set_num_threads(1)
    from unsloth_rollout.areal.distributed import DataParallel, ReplicaLostError
    dp = DataParallel.init(2, timeout_s=60)
    p = torch.nn.Parameter(torch.zeros(3)); p.grad = torch.full((3,), float(dp.rank + 1))
    dp.all_reduce_grads([p])
    assert p.grad.tolist() == [3.0, 3.0, 3.0], p.grad
    dp.check_lockstep(5)                # same version on every replica: fine
    try:
        dp.check_lockstep(5 + dp.rank)  # replicas out of step: refused on every rank
    except RuntimeError as e:
        assert "replicas disagree on the weight version" in str(e), e
    else:
        raise AssertionError("versions 5 and 6 passed the lockstep check")
    if dp.rank == 1:
        os._exit(0)                     # a replica dies between two steps
    time.sleep(1.0)
    try:
        dp.all_reduce_grads([p])
    except ReplicaLostError as e:
        print("NAMED:", e, flush=True)
        sys.exit(3)
    print("NO ERROR", flush=True)
""")


def test_collective_with_a_dead_replica_raises_named_error(tmp_path):
    script = tmp_path / "dead_peer.py"
    script.write_text(_DEAD_PEER)
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = dict(_env(tmp_path), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, AREAL_SPMD_MODE="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert procs[1].returncode == 0, outs[1][-3000:]
    assert procs[0].returncode == 3, outs[0][-3000:]
    assert "NAMED: unsloth:d2: all-reduce of the LoRA gradients failed on rank 0 of 2" in outs[0], outs[0][-3000:]


def test_d3_on_a_two_process_launch_is_refused_at_start(tmp_path):
    # Exactly the README's command, with a replica count that does not match the launch.
    run, log = _run(_torchrun(2, ["-m", "unsloth_rollout.areal.grpo", *_args(tmp_path, "rollout.backend=unsloth:d3")]),
                    tmp_path, 300)
    assert run.returncode != 0, log
    text = run.stdout + run.stderr
    assert "UnsupportedParallelismError: rollout.backend: 'unsloth:d3' asks for 3 data-parallel replica(s) but " \
           "this job runs 2 process(es) (WORLD_SIZE=2)" in text, log
    assert "Train step" not in text


def _config(tmp_path, *overrides):
    from areal.api.cli_args import load_expr_config

    from unsloth_rollout.areal.grpo import UnslothGRPOConfig, _resolve_paths

    config, _ = load_expr_config(_args(tmp_path, *overrides), UnslothGRPOConfig)
    _resolve_paths(config)
    return config


@pytest.mark.parametrize("overrides, match", [
    (("rollout.backend=unsloth:d2t2",), r"rollout\.backend: 'unsloth:d2t2' asks for model parallelism inside a "
                                        r"replica \(t2\); the unsloth backend runs 'unsloth:dN'"),
    (("rollout.backend=unsloth:p2",), r"rollout\.backend: 'unsloth:p2' asks for model parallelism .*\(p2\)"),
    (("rollout.backend=unsloth:d2", "actor.backend=unsloth:d1"),
     r"actor\.backend: 'unsloth:d1' has 1 data-parallel replicas but rollout\.backend 'unsloth:d2' has 2"),
    (("actor.backend=fsdp:d1t2",), r"actor\.backend: 'fsdp:d1t2' asks for model parallelism .*\(t2\)"),
    (("rollout.backend=unsloth:d2",), r"asks for 2 data-parallel replica\(s\) but this job runs 1 process\(es\) "
                                      r"\(WORLD_SIZE=1\).*torchrun --nproc-per-node 2"),
])
def test_unsupported_shapes_refused_before_any_model_loads(tmp_path, monkeypatch, overrides, match):
    from areal.trainer.rl_trainer import PPOTrainer

    import unsloth_rollout.areal as ua
    from unsloth_rollout.areal import train_engine
    from unsloth_rollout.areal.distributed import UnsupportedParallelismError

    ua.install()

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the shape was refused")

    monkeypatch.setattr(train_engine, "load_model", no_load)
    with pytest.raises(UnsupportedParallelismError, match=match) as err:
        PPOTrainer(_config(tmp_path, *overrides), train_dataset=[{}] * 8)
    assert isinstance(err.value, ValueError)  # AReaL's config errors are ValueErrors too


def test_backend_spec_parser_names_supported_shapes():
    from unsloth_rollout.areal._spec import parse_unsloth_backend
    from unsloth_rollout.areal.distributed import UnsupportedParallelismError

    assert parse_unsloth_backend("unsloth:d8").dp == 8
    with pytest.raises(UnsupportedParallelismError, match=r"'unsloth:d2t2'.*runs 'unsloth:dN'"):
        parse_unsloth_backend("unsloth:d2t2")


def _reward_curve(history):
    rewards = [h["ppo_actor/task_reward/avg"] for h in history]
    return rewards, sum(rewards[:3]) / 3, sum(rewards[-5:]) / 5


@pytest.mark.slow
def test_two_replicas_learn_like_one_process(tmp_path):
    """The toy reward rises over a short run with two replicas as it does with one process (sampling on), by the
    criterion of tests/test_areal_grpo_learning.py."""
    import torch

    steps = 30
    one, two = tmp_path / "d1", tmp_path / "d2"
    run1, log1 = _run([sys.executable, str(DRIVER), *_args(one, f"total_train_steps={steps}")], one, 1800)
    assert run1.returncode == 0, log1
    run2, log2 = _run(_torchrun(2, [str(DRIVER), *_args(two, "rollout.backend=unsloth:d2",
                                                      f"total_train_steps={steps}")]), two, 3600)
    assert run2.returncode == 0, log2
    h1 = json.loads((one / "history_rank0.json").read_text())
    h2 = json.loads((two / "history_rank0.json").read_text())
    rank1 = json.loads((two / "history_rank1.json").read_text())  # replica-averaged stats, the same on both
    assert [h["ppo_actor/task_reward/avg"] for h in rank1] == [h["ppo_actor/task_reward/avg"] for h in h2]
    (r1, s1, e1), (r2, s2, e2) = _reward_curve(h1), _reward_curve(h2)
    assert len(r1) == len(r2) == steps
    assert [int(h["unsloth_rollout/version"]) for h in h2] == list(range(1, steps + 1))
    assert e1 >= 3 * s1 or e1 >= 0.8, f"1 process: {s1:.3f} -> {e1:.3f}: {r1}"
    assert e2 >= 3 * s2 or e2 >= 0.8, f"2 replicas: {s2:.3f} -> {e2:.3f}: {r2}"
    assert _lora(two, 0).keys() == _lora(one, 0).keys()
    assert all(torch.equal(v, _lora(two, 1)[k]) for k, v in _lora(two, 0).items())  # still in lockstep


def test_install_lets_areal_launchers_size_an_unsloth_dN_job():
    from areal.api.alloc_mode import _AllocationMode

    import unsloth_rollout.areal as ua

    ua.install()
    mode = _AllocationMode.from_str("unsloth:d8")  # allocation_mode: ${rollout.backend} in the configs
    assert mode.train.world_size == 8 and mode.gen_backend is None  # 8 trainer processes, no LLM servers


def test_areal_local_launcher_starts_n_replicas_under_torchrun(tmp_path, monkeypatch):
    """``python -m unsloth_rollout.areal.launch local``: AReaL's own LocalLauncher, unmodified, sizes the job from
    ``allocation_mode: ${rollout.backend}`` and starts one torchrun of N processes in SPMD mode, no LLM server.
    The launcher assigns GPUs, so on this CPU machine a GPU platform is pretended and the job is recorded, not run."""
    from areal.infra.launcher import local
    from areal.infra.platforms import current_platform

    from unsloth_rollout.areal import launch

    submitted = []
    monkeypatch.setattr(type(current_platform), "device_control_env_var", "CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    monkeypatch.setattr(local.LocalLauncher, "submit_array",
                        lambda self, job_name, cmd, count=1, gpu=0, env_vars=None: submitted.append(
                            (job_name, cmd, count, gpu, dict(env_vars or {}))))
    monkeypatch.setattr(local.LocalLauncher, "wait", lambda self, *a, **k: None)
    monkeypatch.setattr(local.LocalLauncher, "__del__", lambda self: None)
    monkeypatch.setattr(local.name_resolve, "reconfigure", lambda *a, **k: None)  # keep the global repository
    monkeypatch.setattr(local.name_resolve, "clear_subtree", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # launch.main hands its argv to AReaL's launcher
    for d in ("exp", "nr"):
        (tmp_path / d).mkdir()
    launch.main(["local", launch.GRPO_SCRIPT, *_args(tmp_path, "rollout.backend=unsloth:d8")])
    assert len(submitted) == 1, submitted  # the trainer job only: the unsloth backend needs no LLM server
    job, cmd, count, gpu, env = submitted[0]
    assert job == "trainer" and gpu == 8 and env["AREAL_SPMD_MODE"] == "1"
    assert re.search(r"torchrun --nnodes 1 --nproc-per-node 8 .* \S*unsloth_rollout/areal/grpo\.py --config ", cmd), cmd
    assert "rollout.backend=unsloth:d8" in cmd
