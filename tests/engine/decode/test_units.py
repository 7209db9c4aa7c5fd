"""Decoder layers in units: one compiled call runs several consecutive layers (engine/decode/units.py).

Oracles: HF greedy ``generate()`` on the same model object (tokens, with the same hooks and loop changes in
place), a teacher-forced forward (sampled logprobs within 1e-5), and torch._dynamo's own graph counter. The
follower check is held to a model whose decoder loop does not pass a layer its predecessor's output (a layer
class whose ``__call__`` shifts its input, so the unit's chaining would be wrong): the step must notice, run
layer by layer, and stay HF generate's.
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.bench.overhead import deep_policy
from unsloth_rollout.engine.internals import compiled_graphs as _graphs
from unsloth_rollout.engine.decode.units import plan_units
from unsloth_rollout.testing.oracles import assert_greedy_matches, teacher_forced

LAYERS = 6


def _greedy(policy, ids, n):
    out = policy.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _req(ids, n, temperature=0.0, seed=None):
    return GenerationRequest(input_ids=ids, sampling=SamplingParams(
        max_new_tokens=n, temperature=temperature, seed=seed, ignore_eos=temperature > 0))


def _prompts(tok):
    texts = ["the cat", "alice counts twelve red apples in the old market before noon",
             "one two three four five six seven eight nine ten eleven twelve", "Bob and Carol"]
    return [tok.encode(t) for t in texts]


def _check_exact(policy, engine, n=12, label=""):
    """A mixed-length batch, greedy and sampled: tokens are HF generate's, logprobs a teacher-forced forward's."""
    prompts = _prompts(policy.tokenizer)
    greedy = [_req(p, n) for p in prompts]
    sampled = [_req(p, n, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
    outs = engine.generate(greedy + sampled)
    with torch.no_grad():
        for r, o in zip(greedy, outs[:len(greedy)]):
            assert_greedy_matches(policy, r.input_ids, o.output_ids, _greedy(policy, r.input_ids, n), label=label)
        for r, o in zip(greedy + sampled, outs):
            lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, r.sampling.temperature or 1.0)
            torch.testing.assert_close(torch.tensor(o.output_logprobs), lp.float(), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def policy():
    return deep_policy("tiny-lm", LAYERS, 8, 0)  # 6 full-attention Qwen2 layers, random non-zero LoRA


def _engine(policy, per_call=None):
    decode = DecodeConfig(backend="compiled", layers_per_call=per_call)
    return RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, decode=decode), seed=0)


def test_units_of_four_layers_are_exact_and_never_recompile(policy):
    engine = _engine(policy, 4)
    try:
        st = engine.core.runner.decode_steps.compiled
        assert st.units == [[0, 1, 2, 3], [4, 5]] and st.unit_size == 4
        trusted0 = st.trust.trusted_steps
        _check_exact(policy, engine, label="units of 4")
        assert st.trust.trusted_steps - trusted0 >= 8 and st.eager_steps == 0 and st.recompiles == 0
        assert st.trust.graphs is not None and len(st.trust.graphs) == 2 and st.trust.graphs[0] != st.trust.graphs[1]
        assert engine.stats()["decode_layers_per_call"] == 4
    finally:
        engine.shutdown()


def test_default_units_for_a_listed_family(policy):
    engine = _engine(policy)
    try:
        st = engine.core.runner.decode_steps.compiled
        assert st.unit_size == 4 and len(st.units) == 2
    finally:
        engine.shutdown()


@pytest.mark.parametrize("where", ["layer", "global"])
def test_a_hooked_decoder_layer_runs_layer_by_layer(policy, where):
    """A forward hook on one decoder layer, or a global module hook that changes that layer's output, must see the
    layer's own input and output: units are dropped, and the tokens are HF generate's with the same hook."""
    from torch.nn.modules.module import register_module_forward_hook

    engine = _engine(policy, 3)
    # the graph over shared prompts too, before the hook (an engine compiles it before its first group otherwise)
    assert engine.core.runner.decode_steps.compiled.warm_shared()
    layer = engine.core.runner.decode_steps.compiled.layers[1]
    if where == "layer":
        handle = layer.register_forward_hook(lambda mod, args, out: out.mul_(1.5))
    else:  # in place: the next layer is handed the same object (the followers' check alone would not see it)
        handle = register_module_forward_hook(lambda mod, args, out: out.mul_(1.5) if mod is layer else None)
    try:
        st = engine.core.runner.decode_steps.compiled
        assert st.unit_size == 3
        units_trust = st.trust
        _check_exact(policy, engine, label="hooked layer")
        assert st.unit_size == 1 and len(st.units) == LAYERS
        handle.remove()
        engine.weights_changed()  # the model changed: KV the hook made (the prefix cache's) is not reused
        recompiles, graphs = st.recompiles, _graphs()
        _check_exact(policy, engine, n=6, label="hook removed")
        # units again, on the graphs they had: nothing compiled, the unit trust trusted again
        assert st.unit_size == 3 and st.units == [[0, 1, 2], [3, 4, 5]] and st.trust is units_trust
        assert st.recompiles == recompiles and _graphs() == graphs and st.eager_steps == 0
        assert st.trust.graphs is not None and engine.stats()["decode_layers_per_call"] == 3
    finally:
        handle.remove()
        engine.shutdown()


@pytest.mark.parametrize("shared_graph", ["before", "after"])
def test_a_loop_that_changes_what_a_layer_gets_is_caught(policy, shared_graph):
    """Each decoder layer's ``__call__`` shifts its input (the model's loop then passes a layer something other than
    its predecessor's output): the followers notice, the step runs again layer by layer, tokens stay HF's. The
    graph over shared prompts compiled before the change, or after it (before the first group: what that compile
    traced because of the change counts as recompiles)."""
    engine = _engine(policy, 3)
    st = engine.core.runner.decode_steps.compiled
    layers = st.layers
    base = type(layers[0])
    if shared_graph == "before":
        assert st.warm_shared()

    class Shifted(base):
        def __call__(self, hidden_states, *args, **kwargs):
            return super().__call__(hidden_states + 0.25, *args, **kwargs)

    try:
        for m in layers:
            m.__class__ = Shifted
        assert plan_units(layers, 3) == [[0, 1, 2], [3, 4, 5]]
        _check_exact(policy, engine, label="shifted loop")
        assert st.unit_size == 1 and st.recompiles > 0
        tried = st.trusts[3].guarded_steps  # for good: units are not tried again (a hook's case: they are)
        _check_exact(policy, engine, n=4, label="shifted loop, later")
        assert st.unit_size == 1 and st.trusts[3].guarded_steps == tried
    finally:
        for m in layers:
            m.__class__ = base
        engine.shutdown()


def test_plan_units_splits_kinds():
    class A(torch.nn.Module):
        def __init__(self, window):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.sliding_window = window

    layers = [A(8), A(8), A(None), A(8), A(8), A(8), A(8), A(8), A(None)]
    assert plan_units(layers, 4) == [[0, 1], [2], [3, 4, 5, 6], [7], [8]]
    assert plan_units(layers, 1) == [[i] for i in range(9)]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_layers_per_call_is_checked(bad):
    with pytest.raises(InvalidRequestError, match="decode.layers_per_call"):
        EngineConfig(decode=DecodeConfig(layers_per_call=bad))
