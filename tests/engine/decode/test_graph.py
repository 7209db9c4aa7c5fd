"""The graph step: the compiled step replayed as recorded graphs (engine/decode/graph.py, backend "graph").

The CUDA recording itself needs a GPU; here the capture is the CPU stand-in (it re-runs the recorded function on
the graph's own input buffers), which exercises what the engine does around it: the padded buckets, the input
buffers copied before each replay, the signature that drops graphs when the workspace grows or the weights
change, the check of each graph's first replays against the unrecorded step, and switching graphs off when a
recording is wrong. Oracles: HF ``generate()`` (greedy tokens) and a teacher-forced forward (logprobs, 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, RolloutEngine
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine.decode import graph as decode_graphs
from unsloth_rollout.testing.decode import check_greedy_and_logprobs, lora_policy, word_prompts


def _engine(policy):
    return RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, decode=DecodeConfig(backend="graph")))


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(decode_graphs, "ALLOW_STAND_IN", True)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_5_vl"])
def test_replayed_steps_are_exact_and_follow_the_workspace_and_weights(model_dirs, arch, stand_in):
    policy = lora_policy(model_dirs[arch])
    engine = _engine(policy)
    try:
        st = engine.core.runner.decode_steps.compiled
        g = engine.core.runner.decode_steps.graph
        assert g is not None and st.key_align == decode_graphs.KEY_BUCKET
        prompts = word_prompts(policy, 9)
        prompts[4] = (prompts[4] * 30)[:250]  # past the workspace's first capacity: it grows, graphs drop
        check_greedy_and_logprobs(policy, engine, prompts[:1], 20)
        check_greedy_and_logprobs(policy, engine, prompts[:5], 24)
        check_greedy_and_logprobs(policy, engine, prompts, 24)
        stats = engine.stats()
        assert stats["decode_graphs_disabled"] is None
        assert g.captures >= 3 and g.replays > 3 * g.captures  # most steps replayed, not recorded
        assert g.invalidations >= 1 and engine.core.runner.decode_steps.workspace.grows >= 1
        assert st.eager_steps == 0 and st.recompiles == 0
        # An in-place LoRA update (an optimizer step) with no announcement: the replay reads the new values
        # (fresh prompts: the prefix cache's KV of the earlier ones is the old weights' until weights_changed).
        replays = g.replays
        with torch.no_grad():
            for name, p in policy.model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.5)
        check_greedy_and_logprobs(policy, engine, word_prompts(policy, 5, "carol"), 16)
        assert g.replays > replays
        # Announced (weights_changed), and a parameter given new memory without any announcement: no graph
        # recorded before either is replayed after it.
        for change in ("announced", "moved"):
            before = g.invalidations
            if change == "announced":
                engine.weights_changed(1)
            else:
                with torch.no_grad():
                    name, p = next((n, p) for n, p in policy.model.named_parameters() if "lora_B" in n)
                    p.data = p.data * 0.5 + 0.01  # new storage, same shape
            check_greedy_and_logprobs(policy, engine, word_prompts(policy, 5, change), 16)
            assert g.invalidations > before and g.disabled is None, change
    finally:
        engine.shutdown()


def test_a_wrong_recording_is_caught_and_graphs_switch_off(qwen2_dir, stand_in, monkeypatch):
    """A recording that replays stale logits (as one that baked a value in would): its first replay differs from
    the unrecorded step, graphs are switched off, and every token is still the exact one."""

    def stale(fn, pool=None):
        g = decode_graphs._Replayed(fn)
        g.out = fn().clone()
        g.replay = lambda: None  # never recomputes
        return g, g.out

    policy = lora_policy(qwen2_dir)
    engine = _engine(policy)
    monkeypatch.setattr(engine.core.runner.decode_steps.graph, "capture", stale)
    try:
        check_greedy_and_logprobs(policy, engine, word_prompts(policy, 3), 12)
        g = engine.core.runner.decode_steps.graph
        assert g.disabled is not None and "differed" in g.disabled
        assert engine.stats()["decode_graphs_disabled"] == g.disabled
        check_greedy_and_logprobs(policy, engine, word_prompts(policy, 4),
                                  10)  # the compiled step, unrecorded, from then on
    finally:
        engine.shutdown()


def test_a_hook_added_after_recording_is_called(qwen2_dir, stand_in, monkeypatch):
    """A replay runs no Python: a hook registered on a decoder layer's module after its graphs were recorded and
    checked would not be called. Here the stand-in replays with every forward hook muted, as a CUDA graph would;
    while the hook is there the steps run unrecorded (tokens: HF generate's with the hook), and after it is removed
    the recorded graphs replay again."""

    def python_free(fn, pool=None):
        g = decode_graphs._Replayed(fn)
        g.out = fn()

        def replay():
            hooked = [(m, dict(m._forward_hooks)) for m in policy.model.modules() if m._forward_hooks]
            for m, _ in hooked:
                m._forward_hooks.clear()
            try:
                g.out.copy_(fn())
            finally:
                for m, h in hooked:
                    m._forward_hooks.update(h)
        g.replay = replay
        return g, g.out

    policy = lora_policy(qwen2_dir)
    engine = _engine(policy)
    g = engine.core.runner.decode_steps.graph
    monkeypatch.setattr(g, "capture", python_free)
    try:
        prompts = word_prompts(policy, 3)
        check_greedy_and_logprobs(policy, engine, prompts, 12)
        assert g.replays > 2 * g.captures and g.disabled is None  # recorded, checked, trusted
        mlp = engine.core.runner.decode_steps.compiled.layers[1].mlp
        handle = mlp.register_forward_hook(lambda mod, args, out: out * 3.0)
        try:
            replays = g.replays
            check_greedy_and_logprobs(policy, engine, word_prompts(policy, 3, "bob"),
                                      12)  # the same buckets: the graphs would serve
            assert g.replays == replays and g.hooked_steps > 0 and g.disabled is None
        finally:
            handle.remove()
        captures = g.captures
        check_greedy_and_logprobs(policy, engine, word_prompts(policy, 3, "pears"), 12)
        assert g.replays > replays and g.captures == captures  # the graphs recorded before the hook
    finally:
        engine.shutdown()


def test_the_graph_step_on_a_cpu_model_is_refused_by_name(qwen2_dir):
    policy = lora_policy(qwen2_dir)
    with pytest.raises(ValueError, match="decode backend 'graph' needs a CUDA device"):
        _engine(policy)
