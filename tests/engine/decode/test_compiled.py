"""The compiled step (engine/decode/compiled.py, ``DecodeConfig(backend="compiled")``).

Oracles: HF greedy ``generate()`` (tokens), a teacher-forced forward (logprobs within 1e-5), torch._dynamo's own
graph counter (no recompile after warm-up as contexts, batches and the workspace grow), and the eager model after
an in-place LoRA update (the compiled graph reads the parameters, it does not bake them).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams, load_model
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.testing.oracles import perturb_lora, teacher_forced


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def _greedy(policy, ids, n):
    """HF generate's greedy tokens (stopping at EOS, as the engine's greedy requests here do)."""
    out = policy.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def _req(ids, n, temperature=0.0, seed=None, lora_name=None):
    return GenerationRequest(input_ids=ids, lora_name=lora_name, sampling=SamplingParams(
        max_new_tokens=n, temperature=temperature, seed=seed, ignore_eos=temperature > 0))


@pytest.fixture(scope="module")
def served(qwen2_dir):
    """One LoRA policy and one engine on the compiled step (compiled once: warm-up dominates the cost)."""
    torch.manual_seed(0)
    policy = load_model(qwen2_dir, backend="transformers", lora={"r": 8, "random_state": 0})
    perturb_lora(policy.model, std=0.3, seed=0)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20,
                                                decode=DecodeConfig(backend="compiled")))
    yield policy, engine
    engine.shutdown()


def test_compiled_step_is_warm_at_start_and_never_recompiles(served):
    policy, engine = served
    st = engine.core.runner.decode_steps.compiled
    stats = engine.stats()
    assert stats["decode_backend"] == "compiled" and stats["decode_warmup_s"] > 0
    graphs = _graphs()
    tok = policy.tokenizer
    # Batches of 1, 5 and 11 rows (the workspace's rows grow to hold 11), contexts from 3 tokens past 300
    # (its capacity grows past 256), sequences finishing at different steps (the batch shrinks as they go).
    prompts = [tok.encode(" ".join(["alice", "bob", "counts", "apples"][j % 4] for j in range(2 + 9 * i)))
               for i in range(11)]
    prompts[3] = (prompts[3] * 40)[:290]
    rounds = [[0], prompts[1:6], prompts]
    lens = [30, 25, 3, 12, 18, 7, 22, 9, 14, 5, 11]
    steps0 = st.steps
    for batch in rounds:
        batch = [p if isinstance(p, list) else prompts[p] for p in batch]
        reqs = [_req(p, lens[i]) for i, p in enumerate(batch)]
        outs = engine.generate(reqs)
        for r, o in zip(reqs, outs):
            assert o.output_ids == _greedy(policy, r.input_ids, r.sampling.max_new_tokens), r.input_ids[:5]
    ws = engine.core.runner.decode_steps.workspace
    assert ws.k[0].shape[2] > 256 and ws.k[0].shape[0] >= 11
    assert engine.core.runner.decode_steps.workspace.grows >= 2
    assert st.steps - steps0 >= 20 and st.eager_steps == 0
    assert _graphs() == graphs and st.recompiles == 0 and engine.stats()["decode_recompiles"] == 0


def test_compiled_step_compiles_one_graph_for_every_layer(served):
    """The decoder layers share one compiled graph: warm-up does not compile once per layer (one guarded graph
    and its trusted copy, whatever the depth; twice that with the graph of steps over shared prompts)."""
    policy, engine = served
    st = engine.core.runner.decode_steps.compiled
    assert len(st.layers) == engine.core.runner.num_layers == policy.config.num_hidden_layers
    assert policy.config.num_hidden_layers > 1 and st.warm_compiled <= (4 if st.reads_shared() else 2)
    assert st.trust.enabled and st.trust.graphs is not None and len(set(st.trust.graphs)) == 1


def test_compiled_step_logprobs_match_teacher_forced(served):
    policy, engine = served
    tok = policy.tokenizer
    reqs = [_req(tok.encode(p), 16, temperature=t, seed=i) for i, (p, t) in enumerate(
        [("the lazy dog sleeps while", 0.8), ("12 + 7 =", 1.0), ("Bob and Carol went to the market", 1.3)])]
    for r, o in zip(reqs, engine.generate(reqs)):
        lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, r.sampling.temperature)
        assert (torch.tensor(o.output_logprobs) - lp).abs().max() <= 1e-5


def test_compiled_step_follows_in_place_lora_updates(served):
    """An optimizer-style in-place change of every LoRA B is seen by the very next compiled step."""
    policy, engine = served
    ids = policy.tokenizer.encode("alice counts twelve red apples at")
    before = engine.generate([_req(ids, 12)])[0].output_ids
    graphs = _graphs()
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.mul_(-1.5)
    st = engine.core.runner.decode_steps.compiled
    guarded, trusted = st.trust.guarded_steps, st.trust.trusted_steps
    engine.weights_changed(1)
    after = engine.generate([_req(ids, 12)])[0].output_ids
    assert after == _greedy(policy, ids, 12)
    assert after != before, "the update was meant to change the greedy tokens"
    assert _graphs() == graphs
    # the first step after the change is guarded (dynamo re-checks the model), the rest trusted again
    assert st.trust.guarded_steps == guarded + 1 and st.trust.trusted_steps >= trusted + 9


def test_compiled_step_mixed_adapters_run_eager_and_exact(served, tmp_path):
    """Rows naming different adapters (PEFT's per-row adapter_names) fall back to the eager workspace step."""
    policy, engine = served
    other = load_model(policy.name_or_path, backend="transformers", lora={"r": 8, "random_state": 1})
    perturb_lora(other.model, std=0.3, seed=7)
    other.model.save_pretrained(str(tmp_path / "b"))
    engine.load_lora_adapter("b", str(tmp_path / "b"))
    st = engine.core.runner.decode_steps.compiled
    eager0 = st.eager_steps
    ids = policy.tokenizer.encode("Bob and Carol went to")
    outs = engine.generate([_req(ids, 10), _req(ids, 10, lora_name="b")])
    assert st.eager_steps > eager0
    assert outs[0].output_ids == _greedy(policy, ids, 10)
    assert outs[1].output_ids == _greedy(other, ids, 10)
    assert outs[0].output_ids != outs[1].output_ids


@pytest.mark.slow  # a second compile (the VLM's graph): minutes on a shared 2-core machine
def test_compiled_step_mrope_vlm_matches_hf_generate(qwen2_5_vl_dir):
    """Qwen2.5-VL with LoRA: text positions after images carry each row's M-RoPE delta into the graph."""
    import numpy as np
    from PIL import Image

    policy = load_model(qwen2_5_vl_dir, backend="transformers", lora={"r": 8, "random_state": 0})
    perturb_lora(policy.model, std=0.3, seed=1)
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20,
                                                decode=DecodeConfig(backend="compiled")))
    try:
        rng = np.random.default_rng(2)
        images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 40), (30, 70))]
        reqs = [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image"}] * k + [
            {"type": "text", "text": text}]}], images=images[:k], sampling=SamplingParams(max_new_tokens=12,
                                                                                         temperature=0))
            for k, text in ((1, "what is it"), (2, "compare the two pictures please"), (0, "alice counts"))]
        outs = engine.generate(reqs)
        graphs, suppress = _graphs(), engine.core.sampler.suppress_ids or None
        st = engine.core.runner.decode_steps.compiled
        assert st.steps > 0 and st.eager_steps == 0
    finally:
        engine.shutdown()
    for r, o in zip(reqs, outs):
        text = policy.processor.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        inputs = dict(policy.processor(text=[text], images=r.images or None, return_tensors="pt"))
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(policy.dtype)
        policy.clear_rope_deltas()
        ref = policy.model.generate(**inputs, max_new_tokens=12, do_sample=False, suppress_tokens=suppress)
        assert o.prompt_ids == inputs["input_ids"][0].tolist()
        assert o.output_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    assert _graphs() == graphs


def test_engines_of_one_architecture_share_graphs_and_step_exactly_side_by_side(qwen2_dir, monkeypatch):
    """A second engine on another model of the same architecture (other LoRA weights) starts on the first one's
    compiled graphs: it compiles nothing, its steps are trusted, and the two engines, stepping at once in two
    threads, each sample what their own model's teacher-forced forward gives (which graph served a layer is
    recorded per thread). A model of another config gets graphs of its own, and so does an engine that finds the
    region full (dynamo stops compiling a code object past its recompile limit)."""
    import threading

    from unsloth_rollout.engine.decode import trust
    from unsloth_rollout.engine.decode.trust import forget_regions, region_for
    from unsloth_rollout.engine.decode.units import units_call

    forget_regions()
    policies, engines = [], []
    for seed in (0, 1):
        policies.append(load_model(qwen2_dir, backend="transformers", lora={"r": 8, "random_state": seed}))
        assert perturb_lora(policies[-1].model, std=0.3, seed=seed) > 0
    try:
        for i, policy in enumerate(policies):
            graphs = _graphs()
            engines.append(RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20,
                                                              decode=DecodeConfig(backend="compiled")), seed=0))
            st = engines[-1].core.runner.decode_steps.compiled
            assert (st.warm_compiled > 0) == (i == 0) and (_graphs() > graphs) == (i == 0), (i, st.warm_compiled)
        sts = [e.core.runner.decode_steps.compiled for e in engines]
        assert sts[0].trust.region is sts[1].trust.region and sts[0].trust is not sts[1].trust
        key = (units_call, sts[0].mode, sts[0]._signature() + (sts[0].unit_size,))
        assert region_for(*key) is sts[0].trust.region
        with monkeypatch.context() as m:
            m.setattr(trust, "SHARED_GRAPHS", 1)
            assert region_for(*key) is not sts[0].trust.region
        tok = policies[0].tokenizer
        texts = ["the lazy dog sleeps while", "12 + 7 =", "Bob and Carol went to the market", "alice counts"]
        reqs = [_req(tok.encode(t), 24, temperature=1.0, seed=i) for i, t in enumerate(texts)]
        outs, errors, start = [None, None], [], threading.Barrier(2)

        def run(i):
            try:
                start.wait()
                outs[i] = engines[i].generate(reqs)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert outs[0][0].output_ids != outs[1][0].output_ids or outs[0][1].output_ids != outs[1][1].output_ids
        for policy, st, got in zip(policies, sts, outs):
            assert st.trust.trusted_steps >= 20 and st.recompiles == 0 and st.eager_steps == 0
            with torch.no_grad():
                for r, o in zip(reqs, got):
                    lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, 1.0)
                    assert (torch.tensor(o.output_logprobs) - lp).abs().max() <= 1e-5
    finally:
        for e in engines:
            e.shutdown()
    other = load_model(qwen2_dir, backend="transformers", lora={"r": 4, "random_state": 0})
    engine = RolloutEngine(other, EngineConfig(kv_cache_memory_bytes=16 << 20, decode=DecodeConfig(backend="compiled")))
    try:
        st = engine.core.runner.decode_steps.compiled
        assert st.trust.region is not sts[0].trust.region and st.warm_compiled > 0
    finally:
        engine.shutdown()


def test_an_engine_that_cannot_trust_a_shared_region_moves_to_its_own(qwen2_dir):
    """Two engines share a region; one changes its LoRA scale (PEFT's ``set_scale``), so dynamo retraces the shared
    region with the scale as an input, a graph whose trusted copy (which bakes the scale) is never trusted. The
    other engine's next guarded step is served that graph by dynamo: it moves to a region of its own, once, and its
    steps are trusted again there; what it compiles there counts as warm-up. Every step's tokens stay HF greedy's."""
    from unsloth_rollout.engine.decode.trust import forget_regions
    from unsloth_rollout.models.adapters import tuner_layers

    forget_regions()
    policies, engines = [], []
    for seed in (0, 1):
        policies.append(load_model(qwen2_dir, backend="transformers", lora={"r": 8, "random_state": seed}))
        assert perturb_lora(policies[-1].model, std=0.3, seed=seed) > 0
        engines.append(RolloutEngine(policies[-1], EngineConfig(kv_cache_memory_bytes=16 << 20,
                                                                decode=DecodeConfig(backend="compiled")), seed=0))
    try:
        (pa, pb), (ea, eb) = policies, engines
        sa, sb = (e.core.runner.decode_steps.compiled for e in engines)
        ids = pa.tokenizer.encode("erin stacks eleven red cups and")

        def check(policy, engine):
            assert engine.generate([_req(ids, 8)])[0].output_ids == _greedy(policy, ids, 8)
        check(pa, ea)
        check(pb, eb)
        shared = sa.trust.region
        assert sb.trust.region is shared and sb.trust.trusted_steps > 0
        for m in tuner_layers(pa.model):
            if "default" in getattr(m, "scaling", {}):
                m.set_scale("default", 4.0)
        check(pa, ea)
        check(pa, ea)
        assert shared.untrusted, "the scale was meant to make a graph whose copy cannot be trusted"
        eb.weights_changed()
        check(pb, eb)  # a guarded step served the untrusted graph: the engine moves to a region of its own
        assert sb.trust.detached and sb.trust.region is not shared
        check(pb, eb)
        trusted, guarded = sb.trust.trusted_steps, sb.trust.guarded_steps
        check(pb, eb)
        assert sb.trust.trusted_steps > trusted and sb.trust.guarded_steps == guarded and sb.eager_steps == 0
        # what it compiled in its own region is what an engine alone compiles at start: warm-up, not recompiles
        assert not sb.trust.moved and sb.recompiles == 0 and sb.warm_compiled > 0
    finally:
        for e in engines:
            e.shutdown()


def test_the_graphs_a_call_ran_are_recorded_per_thread():
    """Engines sharing a region step in threads of their own: what one thread's call ran is not seen by another
    thread that is between two of its own calls (a guarded step vouches for the graphs its own layers ran)."""
    import threading

    from unsloth_rollout.engine.decode.trust import tagged_backend

    backend = tagged_backend(None)
    if backend is None:
        pytest.skip("this torch has no inductor wrapper class")
    fn = torch.compile(lambda x: x * 2 + 1, backend=backend, dynamic=False)
    x = torch.ones(4)
    fn(x)
    backend.ran = []
    other = threading.Thread(target=lambda: [fn(x) for _ in range(3)])
    other.start()
    other.join()
    assert backend.ran == []
    fn(x)
    assert backend.ran == [0]


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3_text"])
def test_compiled_step_trusted_steps_exact_for_mixed_layer_kinds(family):
    """Families whose layers differ (sliding vs full attention, Gemma 2's soft-capping, Gemma 3's per-kind rotary):
    the guarded step says which graph served each layer, layers of different kinds never share a trusted copy,
    and the trusted steps' tokens and logprobs match HF generate and a teacher-forced forward (prompts past the
    8-token windows)."""
    from unsloth_rollout.testing.families import family_model_path
    from unsloth_rollout.testing.oracles import assert_greedy_matches

    # Gemma 2's soft-capping exists only in its eager attention (transformers' sdpa drops it).
    policy = load_model(str(family_model_path(family)), backend="transformers", lora={"r": 8, "random_state": 0},
                        attn_implementation="eager" if family == "gemma2" else "sdpa")
    assert perturb_lora(policy.model, std=0.3, seed=0) > 0
    engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=16 << 20, block_size=8,
                                                decode=DecodeConfig(backend="compiled")), seed=0)
    try:
        st = engine.core.runner.decode_steps.compiled
        kinds = list(getattr(policy.text_config, "layer_types", None) or [])
        tok = policy.tokenizer
        texts = ["the cat", "alice counts twelve red apples in the old market before noon",
                 "one two three four five six seven eight nine ten eleven twelve thirteen", "Bob and Carol"]
        greedy = [_req(tok.encode(t), 14) for t in texts]
        sampled = [_req(tok.encode(t), 14, temperature=1.0, seed=i) for i, t in enumerate(texts)]
        trusted0 = st.trust.trusted_steps
        outs = engine.generate(greedy + sampled)
        assert st.trust.trusted_steps - trusted0 >= 10 and st.eager_steps == 0 and st.recompiles == 0
        graphs, units = st.trust.graphs, st.units  # a graph per unit of consecutive layers of one kind
        assert graphs is not None and len(graphs) == len(units) and sum(map(len, units)) == len(st.layers)
        if kinds:
            assert len(set(kinds)) > 1, kinds
            assert all(len({kinds[i] for i in u}) == 1 for u in units), (family, kinds, units)
            for i in range(len(graphs)):
                for j in range(len(graphs)):
                    same = kinds[units[i][0]] == kinds[units[j][0]] and len(units[i]) == len(units[j])
                    assert graphs[i] != graphs[j] or same, (family, kinds, units, graphs)
        with torch.no_grad():
            for r, o in zip(greedy, outs[:4]):
                assert_greedy_matches(policy, r.input_ids, o.output_ids, _greedy(policy, r.input_ids, 14), label=family)
            for r, o in zip(greedy + sampled, outs):
                lp, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, r.sampling.temperature or 1.0)
                assert (torch.tensor(o.output_logprobs) - lp).abs().max() <= 1e-5, family
    finally:
        engine.shutdown()


def test_compiled_step_sees_a_hook_registered_after_start(served):
    """A forward hook put on a decoder layer's module after the engine started (no ``weights_changed``): the
    next step is guarded, dynamo traces the hook in, and the tokens follow it (HF generate with the same hook);
    once it is removed, the tokens are the model's own again."""
    policy, engine = served
    st = engine.core.runner.decode_steps.compiled
    # a prompt of its own: the prefix cache would otherwise serve KV computed before the hook (only a weight
    # change, ``weights_changed``, drops it)
    ids = policy.tokenizer.encode("carol weighs seven green pears and")
    mlp = st.layers[1].mlp
    handle = mlp.register_forward_hook(lambda mod, args, out: out * 3.0)
    try:
        guarded = st.trust.guarded_steps
        hooked = engine.generate([_req(ids, 10)])[0].output_ids
        assert st.trust.guarded_steps > guarded
        assert hooked == _greedy(policy, ids, 10)
    finally:
        handle.remove()
    engine.weights_changed()  # the prompt's cached KV was computed with the hook
    plain = engine.generate([_req(ids, 10)])[0].output_ids
    assert plain == _greedy(policy, ids, 10)
    assert plain != hooked, "the hook was meant to change the greedy tokens"


def test_compiled_step_sees_a_parameter_given_another_layout(served):
    """A decoder-layer parameter given new data with the same values but transposed strides after start (no
    ``weights_changed``): the trusted step's graph was compiled for the old layout; its input asserts refuse the
    new one, the step runs again guarded (decode/trust.py), dynamo retraces, and the tokens stay HF generate's.
    A replaced submodule with other weights is followed too."""
    policy, engine = served
    st = engine.core.runner.decode_steps.compiled
    ids = policy.tokenizer.encode("dave paints nine blue boats and")
    want = _greedy(policy, ids, 10)
    engine.generate([_req(ids, 2)])  # a trusted step is possible from here on
    w = st.layers[-1].mlp.down_proj.base_layer.weight
    before = w.data
    w.data = before.t().contiguous().t()  # same values and shape, column-major
    try:
        assert w.stride() != before.stride() and torch.equal(w, before)
        guarded, failed = st.trust.guarded_steps, st.trust.failed_trusted
        assert engine.generate([_req(ids, 10)])[0].output_ids == want
        assert st.trust.guarded_steps > guarded and st.trust.failed_trusted == failed + 1
    finally:
        w.data = before
    layer = st.layers[0]
    norm = layer.post_attention_layernorm
    other = type(norm)(norm.weight.shape[0], eps=norm.variance_epsilon)
    with torch.no_grad():
        other.weight.copy_(norm.weight * -2.0)
    layer.post_attention_layernorm = other
    try:
        changed = _greedy(policy, ids, 10)
        engine.weights_changed()  # the prompt's cached KV came from the old module
        guarded = st.trust.guarded_steps
        assert engine.generate([_req(ids, 10)])[0].output_ids == changed
        assert st.trust.guarded_steps > guarded
        guarded, trusted = st.trust.guarded_steps, st.trust.trusted_steps
        assert engine.generate([_req(ids, 10)])[0].output_ids == changed
        assert st.trust.guarded_steps == guarded and st.trust.trusted_steps > trusted  # trusted on the new module
    finally:
        layer.post_attention_layernorm = norm
        engine.weights_changed()
    assert engine.generate([_req(ids, 10)])[0].output_ids == want


def test_engine_follows_peft_switches_without_weights_changed(served):
    """PEFT's own switches change what the model computes without touching a weight, and callers do not pair
    them with ``weights_changed``: ``with model.disable_adapter():``, ``set_scale``, ``merge_adapter`` /
    ``unmerge_adapter``. The engine serves the model as it is at each step (HF generate under the same switch):
    a prompt cached under LoRA is not reused with the adapter off, a trusted compiled step traced with LoRA on
    does not run with it off (else the prefill would run the base model and the decode steps the LoRA one), and
    once the switch is back the trusted steps resume."""
    from unsloth_rollout.models.adapters import tuner_layers

    policy, engine = served
    st, model = engine.core.runner.decode_steps.compiled, policy.model
    ids = policy.tokenizer.encode("erin stacks eleven red cups and")
    fresh = policy.tokenizer.encode("frank hums twelve quiet songs while")
    lora = _greedy(policy, ids, 10)
    assert engine.generate([_req(ids, 10)])[0].output_ids == lora  # cached (prefix) and traced under LoRA
    switches = engine.stats()["adapter_switch_changes"]
    with model.disable_adapter():
        base, base_fresh = _greedy(policy, ids, 10), _greedy(policy, fresh, 10)
        assert base != lora, "the adapter was meant to change the greedy tokens"
        guarded = st.trust.guarded_steps
        assert engine.generate([_req(ids, 10)])[0].output_ids == base
        assert engine.generate([_req(fresh, 10)])[0].output_ids == base_fresh
        assert st.trust.guarded_steps > guarded
    assert engine.generate([_req(ids, 10)])[0].output_ids == lora
    trusted, guarded = st.trust.trusted_steps, st.trust.guarded_steps
    assert engine.generate([_req(ids, 10)])[0].output_ids == lora
    assert st.trust.trusted_steps > trusted and st.trust.guarded_steps == guarded  # trusted again
    layers = [(m, m.scaling["default"]) for m in tuner_layers(model) if "default" in getattr(m, "scaling", {})]
    for m, _ in layers:
        m.set_scale("default", 4.0)  # scaling = 4 * alpha / r, in place in each layer's dict
    try:
        scaled = _greedy(policy, ids, 10)
        assert scaled != lora
        assert engine.generate([_req(ids, 10)])[0].output_ids == scaled
    finally:
        for m, s in layers:
            m.scaling["default"] = s
    assert engine.generate([_req(ids, 10)])[0].output_ids == lora
    model.merge_adapter()
    try:  # LoRA folded into the base weights: applying it again on top would be wrong
        merged = _greedy(policy, ids, 10)
        assert engine.generate([_req(ids, 10)])[0].output_ids == merged
    finally:
        model.unmerge_adapter()
    assert engine.generate([_req(ids, 10)])[0].output_ids == _greedy(policy, ids, 10)
    assert engine.stats()["adapter_switch_changes"] == switches + 6  # each switch on and each off
