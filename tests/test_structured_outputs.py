"""Structured outputs in the engine: a grammar per sample (llguidance), masked before sampling.

Oracles: ``jsonschema`` (every finished json_schema output validates), ``re.fullmatch`` / the choice list, a
teacher-forced forward (raw logprobs), an independent replay of the grammar with llguidance's own matcher
(the renormalised logprobs), and the same seeded requests run without any constrained neighbour (unconstrained
rows are untouched).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from unsloth_rollout import (EngineConfig, GenerationRequest, InvalidRequestError, RolloutEngine,  # noqa: E402
                             SamplingParams, load_model)
from unsloth_rollout.engine.constraints import JSON_STYLE, StructuredOutputs  # noqa: E402
from unsloth_rollout.testing.oracles import teacher_forced  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                      "metric": {"type": "boolean"}},
     "required": ["city", "days", "metric"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
                                "required": ["id"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]
PROMPT = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def policy(qwen2_dir):
    return load_model(qwen2_dir, backend="transformers")


@pytest.fixture(scope="module")
def engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=512))
    yield eng
    eng.shutdown()


def _gen(engine, structured=None, n=16, seed=0, max_new_tokens=48, **sp):
    return engine.generate(GenerationRequest(messages=PROMPT, sampling=SamplingParams(
        max_new_tokens=max_new_tokens, n=n, seed=seed, structured_outputs=structured, **sp)))


def test_json_schema_outputs_validate_where_the_model_alone_emits_garbage(engine):
    free = [o.text for o in _gen(engine, n=32, seed=7)]
    assert sum(_is_json(t) for t in free) == 0  # the random model on its own never writes JSON
    finished = 0
    for k, schema in enumerate(SCHEMAS):
        for seed in range(3):
            for o in _gen(engine, {"json": schema}, seed=seed, temperature=1.0 + 0.2 * seed):
                assert o.error is None and o.finish_reason in ("stop", "length")
                if o.finish_reason == "stop":
                    jsonschema.validate(json.loads(o.text), schema)
                    assert o.output_ids[-1] in engine.eos_ids
                    finished += 1
    assert finished >= 0.9 * len(SCHEMAS) * 3 * 16  # bounded schemas: nearly every sample completes


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_json_object_regex_and_choice(engine):
    for o in _gen(engine, {"json_object": True}, n=8, max_new_tokens=64):
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    for o in _gen(engine, {"regex": r"[0-9]{3}-[a-z]{2}"}, n=8):
        assert o.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", o.text)
    choices = ["yes", "no", "maybe later"]
    outs = _gen(engine, {"choice": choices}, n=16)
    assert all(o.finish_reason == "stop" and o.text in choices for o in outs)
    assert len({o.text for o in outs}) > 1  # sampled, not forced to one answer


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_logprobs_raw_policy_and_renormalised_within_the_grammar(engine, policy, temperature, top_p):
    """output_logprobs: log_softmax(raw / T) (what a trainer recomputes); output_constrained_logprobs: the same
    renormalised over the tokens the grammar allowed, replayed here with a fresh llguidance matcher."""
    import llguidance.hf

    schema = SCHEMAS[0]
    outs = _gen(engine, {"json": schema}, n=4, seed=3, temperature=temperature, top_p=top_p)
    tok = llguidance.hf.from_tokenizer(policy.tokenizer, n_vocab=len(policy.tokenizer))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
    t = temperature if temperature > 0 else 1.0
    for o in outs:
        ref, logits = teacher_forced(policy, o.prompt_ids, o.output_ids, temperature=t)
        assert (ref - torch.tensor(o.output_logprobs)).abs().max().item() <= 1e-5
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        want = []
        for i, token in enumerate(o.output_ids):
            bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)
            allowed = [v for v in range(logits.shape[1]) if v < 32 * len(bits) and (int(bits[v // 32]) >> (v % 32)) & 1]
            if m.is_accepting():
                allowed = sorted(set(allowed) | set(engine.eos_ids))
            assert token in allowed
            lp = torch.log_softmax(logits[i] / t, dim=-1)
            want.append((lp[token] - torch.logsumexp(lp[allowed], dim=0)).item())
            if token not in engine.eos_ids:
                assert m.consume_token(token)
        assert o.output_constrained_logprobs == pytest.approx(want, abs=1e-5)
        assert all(c >= r - 1e-6 for c, r in zip(o.output_constrained_logprobs, o.output_logprobs))


def test_unconstrained_rows_are_bit_identical_beside_constrained_ones(engine):
    """The sampler with and without a constrained row in its batch: every other row's token and logprob are the
    same bits (and in the engine, the same tokens)."""
    from unsloth_rollout.engine.inputs import PreparedPrompt
    from unsloth_rollout.engine.sequence import Sequence

    sampler = engine.core.sampler
    grammar = engine.core.grammars.compile(StructuredOutputs(json=SCHEMAS[1]))
    params = [dict(seed=1, temperature=0.9, top_k=50), dict(seed=2, top_p=0.8), dict(temperature=0.0),
              dict(seed=3, repetition_penalty=1.3, min_new_tokens=2)]
    logits = torch.randn(len(params) + 1, len(engine.tokenizer) + 7, generator=torch.Generator().manual_seed(0))

    def rows(with_constrained: bool):
        seqs = [Sequence(f"r{i}", 0, PreparedPrompt([5, 6, 7]), SamplingParams(**p)) for i, p in enumerate(params)]
        if with_constrained:
            c = Sequence("c", 0, PreparedPrompt([5, 6, 7]), SamplingParams(seed=9))
            c.constraint = grammar.matcher()
            seqs.insert(2, c)
        return seqs

    alone = sampler(logits[[0, 1, 3, 4]], rows(False))
    mixed = sampler(logits, rows(True))
    keep = [0, 1, 3, 4]
    assert [mixed.tokens[i] for i in keep] == alone.tokens
    assert [mixed.logprobs[i] for i in keep] == alone.logprobs  # exact, not approximate
    assert alone.constrained is None and [mixed.constrained[i] for i in keep] == [None] * 4
    assert mixed.constrained[2] is not None

    def free(seed):
        return GenerationRequest(messages=PROMPT, sampling=SamplingParams(max_new_tokens=24, n=3, seed=seed,
                                                                         temperature=0.9, top_k=50))
    alone = engine.generate([free(1), free(2)])
    mixed = engine.generate([free(1), GenerationRequest(messages=PROMPT, sampling=SamplingParams(
        max_new_tokens=24, n=4, seed=5, structured_outputs={"json": SCHEMAS[1]})), free(2)])
    assert [o.output_ids for o in mixed[0:3] + mixed[7:10]] == [o.output_ids for o in alone]


def test_bad_constraints_are_refused_by_name(engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.submit(GenerationRequest(input_ids=[1, 2], sampling=SamplingParams(
            structured_outputs={"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}})))
    assert e.value.field == "structured_outputs" and "compile" in str(e.value)
    for bad, field in [({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
                       ({"choice": []}, "structured_outputs.choice"), ({"xml": "<a/>"}, "structured_outputs.xml"),
                       ({"json": "{not json"}, "structured_outputs.json")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(structured_outputs=bad)
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(ignore_eos=True, structured_outputs={"json_object": True})
    assert e.value.field == "ignore_eos"
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputs(grammar=3)
    assert e.value.field == "structured_outputs.grammar"


def test_grammar_done_before_min_tokens_fails_that_sample_by_name(engine):
    bad, good = engine.generate([
        GenerationRequest(input_ids=[5, 6, 7], sampling=SamplingParams(
            max_new_tokens=8, min_new_tokens=6, structured_outputs={"choice": ["ok"]})),
        GenerationRequest(input_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=4, seed=0))])
    assert bad.finish_reason == "abort" and bad.error.startswith("ConstraintError") and "min_tokens" in bad.error
    assert good.error is None and len(good.output_ids) == 4  # the engine goes on serving the others


def test_the_test_tokenizers_compile(policy, qwen2_5_vl_dir):
    """Every tokenizer the tests serve (the tiny BPE with Qwen's added tokens, a VLM's, the real checkpoint's)
    wraps for llguidance and constrains a sample."""
    from unsloth_rollout.engine.constraints import GrammarCompiler
    from unsloth_rollout.testing.real import real_checkpoint_path

    from transformers import AutoTokenizer

    toks = [policy.tokenizer, load_model(qwen2_5_vl_dir, backend="transformers").tokenizer,
            AutoTokenizer.from_pretrained(str(real_checkpoint_path()))]  # SmolLM2's GPT-2-style BPE
    for t in toks:
        g = GrammarCompiler(t).compile(StructuredOutputs(json=SCHEMAS[0])).matcher()
        bitmask = torch.zeros(1, g.words, dtype=torch.int32)
        g.fill(bitmask, 0)
        assert int(bitmask.ne(0).sum()) >= 1


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_forced_tool_calls_parse_with_schema_valid_arguments_in_both_formats(engine, policy, fmt):
    from unsloth_rollout.engine.tool_grammar import tool_call_outputs
    from unsloth_rollout.serve.tools import parse_tool_calls

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[0]}},
             {"type": "function", "function": {"name": "tag", "parameters": SCHEMAS[1]}}]
    schema_of = {"get_weather": SCHEMAS[0], "tag": SCHEMAS[1]}
    tok = policy.tokenizer
    for parallel in (True, False):
        outs = _gen(engine, tool_call_outputs(fmt, tools, "required", parallel, tok), n=16, seed=4,
                    max_new_tokens=96)
        done = [o for o in outs if o.finish_reason == "stop"]
        assert len(done) >= 12
        for o in done:
            parsed = parse_tool_calls(o.text, fmt)
            assert parsed.calls and (parallel or len(parsed.calls) == 1)
            for name, args in parsed.calls:
                jsonschema.validate(json.loads(args), schema_of[name])
            if fmt == "hermes":  # the tag is the tokenizer's own added token, as the chat template renders it
                assert o.output_ids[0] == tok.convert_tokens_to_ids("<tool_call>") and parsed.content is None
    named = tool_call_outputs(fmt, tools, {"type": "function", "function": {"name": "tag"}}, True, tok)
    for o in _gen(engine, named, n=8, seed=5, max_new_tokens=96):
        if o.finish_reason == "stop":
            assert [n for n, _ in parse_tool_calls(o.text, fmt).calls] == ["tag"]


def test_without_llguidance_a_constrained_request_is_refused_by_name(policy, monkeypatch):
    import sys

    from unsloth_rollout.engine.constraints import GrammarCompiler

    monkeypatch.setitem(sys.modules, "llguidance", None)
    monkeypatch.setitem(sys.modules, "llguidance.hf", None)
    with pytest.raises(InvalidRequestError) as e:
        GrammarCompiler(policy.tokenizer).compile(StructuredOutputs(json_object=True))
    assert e.value.field == "structured_outputs" and "llguidance" in str(e.value)


def test_processed_logprobs_include_the_grammar_mask(engine):
    """vLLM's processed logprobs are taken after its grammar bitmask: with no other processing they are exactly
    the grammar-renormalised logprobs."""
    raw = _gen(engine, {"json": SCHEMAS[0]}, n=4, seed=8)
    proc = _gen(engine, {"json": SCHEMAS[0]}, n=4, seed=8, logprobs_mode="processed_logprobs")
    for r, p in zip(raw, proc):
        assert p.output_ids == r.output_ids
        assert p.output_logprobs == pytest.approx(r.output_constrained_logprobs, abs=1e-5)
        assert p.output_constrained_logprobs == pytest.approx(r.output_constrained_logprobs, abs=1e-6)
