"""Tool-calling VLM agents on the unsloth backend, on the tiny Qwen2.5-VL, CPU, offline.

- ArealOpenAI (areal 1.0.4, no sglang / vllm) returns parsed tool_calls for Hermes/Qwen and Llama-3 JSON
  output, identical to what the project's server returns for the same model text;
- multi-turn VLM trajectories (an image in turn 1, a tool-returned image in turn 3) carry the engine's own
  pixel values; their logprobs match a teacher-forced forward over the whole conversation; the train
  engine's forward sees exactly those pixels (a hook on the vision tower);
- an agent written against ``openai.AsyncOpenAI(base_url=...)`` runs unchanged on the engine's in-process
  server, its interactions recorded the way AReaL's proxy records them; bad agents end their episode only.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal import install  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402
from unsloth_rollout.testing.logs import captured  # noqa: E402

try:  # tests/ as a package or as a plain folder on sys.path
    from tests._areal_helpers import ForcedOutput, png_data_url, random_image  # noqa: E402
except ImportError:
    from _areal_helpers import ForcedOutput, png_data_url, random_image  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "count", "description": "Count the shapes of one color",
                                      "parameters": {"type": "object", "properties": {"color": {"type": "string"}},
                                                     "required": ["color"]}}},
    {"type": "function", "function": {"name": "zoom", "description": "Zoom into a region of the image",
                                      "parameters": {"type": "object", "properties": {
                                          "region": {"type": "string", "enum": ["top", "bottom", "left", "right"]}},
                                          "required": ["region"]}}},
]
HERMES_TEXT = ('Let me look.\n<tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "zoom", "arguments": {"region": "top"}}\n</tool_call>')
THINK_HERMES_TEXT = ('<think>red first</think><tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n'
                     '</tool_call>')
LLAMA_TEXT = '{"name": "count", "parameters": {"color": "blue"}}; {"name": "zoom", "parameters": {"region": "left"}}'


@pytest.fixture(scope="module")
def policy(qwen2_5_vl_dir):
    install()
    return load_model(qwen2_5_vl_dir, backend="transformers", lora={"r": 8, "random_state": 0})


@pytest.fixture(scope="module")
def rollout_engine(policy):
    eng = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=32 << 20, max_model_len=1024), seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def engine(rollout_engine):
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2,
                                                     max_head_offpolicyness=int(1e10)),  # no staleness gate
                               rollout_engine=rollout_engine)
    e.initialize()
    yield e
    e.destroy()


def _calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls or []:
        fn = c["function"] if isinstance(c, dict) else c.function
        name, args = (fn["name"], fn["arguments"]) if isinstance(fn, dict) else (fn.name, fn.arguments)
        out.append((name, json.loads(args)))
    return out


def _server_message(rollout_engine, parser: str, messages, text: str) -> dict:
    from starlette.testclient import TestClient

    from unsloth_rollout.serve import create_app

    app = create_app(rollout_engine, served_model_name="tiny", tool_call_parser=parser)
    with TestClient(app) as client, ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "tools": TOOLS,
                                                       "max_tokens": 128, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


# ============================================================================ 1. tool calls through ArealOpenAI
@pytest.mark.parametrize("areal_parser,server_parser,text,want", [
    ("qwen", "hermes", HERMES_TEXT, [("count", {"color": "red"}), ("zoom", {"region": "top"})]),
    ("hermes", "hermes", THINK_HERMES_TEXT, [("count", {"color": "red"})]),
    ("llama3_json", "llama3_json", LLAMA_TEXT, [("count", {"color": "blue"}), ("zoom", {"region": "left"})]),
])
def test_areal_openai_tool_calls_match_the_server(engine, rollout_engine, areal_parser, server_parser, text, want):
    from areal.experimental.openai import ArealOpenAI

    from unsloth_rollout.areal.openai_compat import external_parsers_installed

    if external_parsers_installed():
        pytest.skip("this test is about an install without sglang / vllm (AReaL then uses their parsers)")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(1)}},
                                             {"type": "text", "text": "How many red shapes?"}]}]
    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser=areal_parser)
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
        comp = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS, max_completion_tokens=128,
                                                          temperature=0))
    choice = comp.choices[0]
    assert _calls(choice.message.tool_calls) == want
    assert choice.finish_reason == "tool_calls"

    served = _server_message(rollout_engine, server_parser, messages, text)
    assert _calls(served["message"]["tool_calls"]) == want  # the same calls, same argument strings
    assert [c.function.arguments for c in choice.message.tool_calls] == \
        [c["function"]["arguments"] for c in served["message"]["tool_calls"]]
    assert (choice.message.content or None) == served["message"]["content"]
    assert served["finish_reason"] == "tool_calls"


def test_areal_openai_plain_and_malformed_text_has_no_tool_calls(engine, rollout_engine):
    from areal.experimental.openai import ArealOpenAI

    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen")
    messages = [{"role": "user", "content": "hi"}]
    for text in ("just an answer: 3", '<tool_call>\n{"name": "count", "arguments": {broken\n</tool_call>'):
        with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
            comp = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS,
                                                              max_completion_tokens=64, temperature=0))
        assert comp.choices[0].message.tool_calls is None
        assert comp.choices[0].message.content == text and comp.choices[0].finish_reason == "stop"
        served = _server_message(rollout_engine, "hermes", messages, text)
        assert served["message"]["tool_calls"] == [] and served["message"]["content"] == text


def test_unknown_parser_name_is_a_clear_error(engine, rollout_engine):
    from areal.experimental.openai import ArealOpenAI

    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen3_coder")
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode("x")):
        with pytest.raises(ValueError, match="tool_call_parser"):
            asyncio.run(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                                       max_completion_tokens=8, temperature=0))


# ============================================================================ 2. multi-turn VLM trajectories
ZOOM_CALL = '<tool_call>\n{"name": "zoom", "arguments": {"region": "top"}}\n</tool_call>'


def _two_image_episode(engine, rollout_engine, template: str):
    """Turn 1: user image + question -> (forced) zoom call; turn 3: the tool returns a new image -> sampled."""
    from areal.experimental.openai import ArealOpenAI

    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen",
                         chat_template_type=template)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(11, 56)}},
                                             {"type": "text", "text": "How many red shapes are at the top?"}]}]
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(ZOOM_CALL)):
        c1 = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS, max_completion_tokens=64))
    assert _calls(c1.choices[0].message.tool_calls) == [("zoom", {"region": "top"})]
    messages.append(c1.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": c1.choices[0].message.tool_calls[0].id,
                     "content": [{"type": "image_url", "image_url": {"url": png_data_url(12, 84)}},
                                 {"type": "text", "text": "the top half, zoomed in"}]})
    asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS, max_completion_tokens=12,
                                                    temperature=1.0))
    client.set_last_reward(1.0)
    return client, [random_image(11, 56), random_image(12, 84)]


def _oracle(policy, traj, images):
    """Teacher-forced forward over the whole sequence, pixels from the processor (independently of the engine)."""
    enc = policy.processor.image_processor(images=images, return_tensors="pt")
    ids = traj["input_ids"][0]
    types = torch.zeros_like(ids).unsqueeze(0)
    types[0, ids == policy.config.image_token_id] = 1
    policy.clear_rope_deltas()
    with policy.lock, torch.no_grad():
        logits = policy.model(input_ids=ids.unsqueeze(0), attention_mask=torch.ones_like(ids).unsqueeze(0),
                              pixel_values=enc["pixel_values"].to(policy.dtype), image_grid_thw=enc["image_grid_thw"],
                              mm_token_type_ids=types, use_cache=False).logits[0].float()
    policy.clear_rope_deltas()
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros(1), lp]), enc  # lp[t] = log p(token t | < t), as AReaL stores logprobs


def _vision_hook(policy):
    visual = next(m for n, m in policy.model.named_modules() if n.endswith("visual"))
    seen = []

    def hook(module, args, kwargs):
        seen.append((kwargs.get("hidden_states", args[0] if args else None)).detach().clone())

    return visual.register_forward_pre_hook(hook, with_kwargs=True), seen


@pytest.mark.parametrize("template,style", [("concat", "concat"), ("hf", "individual")])
def test_multi_turn_vlm_trajectory_carries_the_rollout_pixels(engine, rollout_engine, policy, template, style):
    from areal.api import FinetuneSpec, WeightUpdateMeta
    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.utils.data import concat_padded_tensors

    from unsloth_rollout.areal import ColocatedTrainEngine

    client, images = _two_image_episode(engine, rollout_engine, template)
    client.apply_reward_discount(turn_discount=1.0)
    trajs = [v.to_tensor_dict() for v in client.export_interactions(style=style).values()]
    assert len(trajs) == (1 if style == "concat" else 2)
    last = trajs[-1]
    n_image_tokens = int((last["input_ids"] == policy.config.image_token_id).sum())
    oracle_lp, enc = _oracle(policy, last, images)
    assert n_image_tokens == int(enc["image_grid_thw"].prod(-1).sum()) // 4  # both images, expanded
    (mm,) = last["multi_modal_input"]
    assert torch.equal(mm["pixel_values"], enc["pixel_values"]) and torch.equal(mm["image_grid_thw"],
                                                                                enc["image_grid_thw"])
    mask = last["loss_mask"][0].bool()
    if style == "concat":  # both assistant turns are trained in the one trajectory
        assert int(last["versions"][0][mask].ne(-1).sum()) == int(mask.sum())
        turns = (mask[1:] & ~mask[:-1]).sum() + int(mask[0])
        assert int(turns) == 2
    gap = (last["logprobs"][0][mask] - oracle_lp[mask]).abs().max().item()
    assert gap < 1e-5, gap
    if style == "individual":  # turn 1 alone: its own image only
        (mm1,) = trajs[0]["multi_modal_input"]
        assert torch.equal(mm1["pixel_values"], enc["pixel_values"][: int(enc["image_grid_thw"][0].prod())])

    # The train engine's forward (and loss) run on exactly these pixels.
    cfg = TrainEngineConfig(experiment_name="t", trial_name="t", path="", dtype="float32",
                            optimizer=OptimizerConfig(lr=1e-4, weight_decay=0.0, warmup_steps_proportion=0.0))
    train = ColocatedTrainEngine(cfg, policy)
    train.initialize(ft_spec=FinetuneSpec(total_train_epochs=1, dataset_size=2, train_batch_size=2))
    train.connect_engine(engine, WeightUpdateMeta(type="disk"))
    batch = concat_padded_tensors(trajs)
    handle, seen = _vision_hook(policy)
    try:
        recomputed = train.forward_batch(batch)
        train.train_batch(batch, loss_fn=lambda logp, ent, mb: -(logp * torch.roll(mb["loss_mask"], -1, -1)).sum(),
                          loss_weight_fn=lambda mb: float(mb["loss_mask"].sum()))
    finally:
        handle.remove()
        train.update_weights(WeightUpdateMeta(type="disk", version=engine.get_version() + 1))  # new KV from here
    want = torch.cat([t["multi_modal_input"][0]["pixel_values"] for t in trajs], 0)
    assert len(seen) == 2 and all(torch.equal(s, want) for s in seen)
    shifted = torch.roll(batch["logprobs"], -1, -1)
    m = torch.roll(batch["loss_mask"], -1, -1).bool()
    assert (recomputed - shifted)[m].abs().max().item() < 1e-5


# ============================================================================ 3. agent workflows (plain openai SDK)
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples"


def _example():
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    from shapes_agent import agent, env

    return agent, env


def _count_call(color: str) -> str:
    return f'<tool_call>\n{{"name": "count", "arguments": {{"color": "{color}"}}}}\n</tool_call>'


def _by_turn(rollout_engine, texts: list[str]):
    """A ForcedOutput script per turn of a chat: turn k's prompt holds 2 + 2k end-of-turn tokens."""
    tok = rollout_engine.tokenizer
    ids = [tok.encode(t) for t in texts]
    im_end = tok.eos_token_id

    def pick(seq):
        turn = (seq.prompt.prompt_ids.count(im_end) - 2) // 2
        return ids[min(max(turn, 0), len(ids) - 1)]

    return ForcedOutput(rollout_engine, pick)


def _hf_oracle(policy, messages, tools, output_ids):
    """Prompt ids from the HF chat template (tool-call arguments as objects, as vLLM renders them, images
    expanded by the processor's grid) and teacher-forced logprobs of ``output_ids`` with the processor's pixels."""
    import base64
    import io

    from PIL import Image

    images, msgs = [], []
    for m in messages:
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if p.get("type") == "image_url":
                    images.append(Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
                                  .convert("RGB"))
                    parts.append({"type": "image"})
                else:
                    parts.append(p)
            m["content"] = parts
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        msgs.append(m)
    tok = policy.tokenizer
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    enc = policy.processor.image_processor(images=images, return_tensors="pt")
    counts = iter([int(g.prod()) // 4 for g in enc["image_grid_thw"]])
    pad = policy.config.image_token_id
    expanded = [x for t in ids for x in ([t] * next(counts) if t == pad else [t])]
    full = torch.tensor([expanded + list(output_ids)])
    types = (full == pad).long()
    policy.clear_rope_deltas()
    with policy.lock, torch.no_grad():
        logits = policy.model(input_ids=full, attention_mask=torch.ones_like(full), pixel_values=enc["pixel_values"],
                              image_grid_thw=enc["image_grid_thw"], mm_token_type_ids=types, use_cache=False).logits
    policy.clear_rope_deltas()
    lp = torch.log_softmax(logits[0].float(), -1)[len(expanded) - 1:-1]
    return expanded, lp.gather(-1, torch.tensor(output_ids).unsqueeze(-1)).squeeze(-1), enc


def test_agent_server_records_each_interaction_like_arealopenai(engine, rollout_engine, policy):
    from areal.experimental.openai import ArealOpenAI

    from unsloth_rollout.areal.agent_server import AgentServer

    agent_mod, env = _example()
    data = {"scene_seed": 7, "color": "red"}
    scene = env.Scene(7)
    script = [ZOOM_CALL, _count_call("red"), f"There are {scene.answer('red')}."]
    server = AgentServer(rollout_engine, tool_call_parser="qwen")
    try:
        session = server.start_session()
        with _by_turn(rollout_engine, script):
            reward = asyncio.run(agent_mod.ShapesAgent(max_tokens=64).run(data, base_url=server.base_url,
                                                                          api_key=session.key))
        server.end_session(session.key)
        # An ended session's key is refused; other keys are served unrecorded.
        import httpx

        r = httpx.post(server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {session.key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 401 and "session" in r.json()["error"]["message"]
    finally:
        server.close()
    assert reward == 1.0
    session.cache.set_last_reward(reward)
    inters = list(session.cache.export_interactions("individual", reward_discount=1.0).values())
    assert [len(i.messages) for i in inters] == [2, 4, 6] and [i.reward for i in inters] == [1.0, 1.0, 1.0]
    assert [_calls(i.completion.choices[0].message.tool_calls) for i in inters] == \
        [[("zoom", {"region": "top"})], [("count", {"color": "red"})], []]
    for inter in inters:
        t = inter.to_tensor_dict()
        out = inter.model_response.output_tokens
        prompt, oracle_lp, enc = _hf_oracle(policy, inter.messages, env.TOOLS, out)
        assert inter.model_response.input_tokens == prompt  # images expanded, arguments rendered as objects
        assert torch.equal(t["multi_modal_input"][0]["pixel_values"], enc["pixel_values"])
        assert (torch.tensor(inter.model_response.output_logprobs) - oracle_lp).abs().max().item() < 1e-5
        assert t["loss_mask"][0].sum().item() == len(out) and (t["versions"][0][t["loss_mask"][0].bool()] >= 0).all()

    # The first turn, through AReaL's own client on the same engine: the same trajectory.
    client = ArealOpenAI(engine=engine, tokenizer=rollout_engine.tokenizer, tool_call_parser="qwen")
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(script[0])):
        asyncio.run(client.chat.completions.create(messages=inters[0].messages, tools=env.TOOLS,
                                                   max_completion_tokens=64, temperature=1.0))
    client.set_last_reward(1.0)
    client.apply_reward_discount(turn_discount=1.0)
    (theirs,) = client.export_interactions("individual").values()
    a, b = inters[0].to_tensor_dict(), theirs.to_tensor_dict()
    for k in ("input_ids", "loss_mask", "versions", "attention_mask", "rewards"):
        assert torch.equal(a[k], b[k]), k
    assert (a["logprobs"] - b["logprobs"]).abs().max().item() < 1e-5
    assert torch.equal(a["multi_modal_input"][0]["pixel_values"], b["multi_modal_input"][0]["pixel_values"])
    assert _calls(theirs.output_message_list[0]["tool_calls"]) == _calls(inters[0].output_message_list[0]["tool_calls"])


class _RaisesAfterOneCall:
    """Makes one completion, then fails (a bug in the agent's own code)."""

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw.get("http_client"))
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        raise RuntimeError("the agent's environment crashed")


class _OverflowsTheContext:
    """One fine turn, then a prompt longer than the engine's context (the server answers 400)."""

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw.get("http_client"),
                             max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        c = await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        messages += [c.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "x " * 3000}]
        await client.chat.completions.create(model="any", messages=messages, max_tokens=4)
        return 1.0


class _Hangs:
    """One completion, then waits for ever (a stuck tool)."""

    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw.get("http_client"))
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        await asyncio.sleep(3600)
        return 1.0


class _NoCompletion:
    async def run(self, data, **kw):
        return 1.0


class _BadReward:
    async def run(self, data, **kw):
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"], http_client=kw.get("http_client"))
        await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        return "great"


def test_agent_workflow_runs_unchanged_and_bad_agents_end_only_their_episode(engine, rollout_engine):
    from unsloth_rollout.areal import agent_server
    from unsloth_rollout.areal.agent_server import UnslothAgentWorkflow

    agent_mod, env = _example()
    data = env.dataset(2, seed=3)
    answers = [env.Scene(d["scene_seed"]).answer(d["color"]) for d in data]
    # Two turns each: a count call (text result), then the right answer: reward 1 for every completion.
    scene_answer = {d["scene_seed"]: a for d, a in zip(data, answers)}

    def pick(seq, tok=rollout_engine.tokenizer):
        turn = (seq.prompt.prompt_ids.count(tok.eos_token_id) - 2) // 2
        if turn == 0:
            return tok.encode(_count_call("red"))
        text = tok.decode(seq.prompt.prompt_ids)  # which scene: the one whose red count the tool returned
        n = next(a for s, a in scene_answer.items()
                 if f"<tool_response>\n{env.Scene(s).call('count', {'color': 'red'})}" in text)
        return tok.encode(str(n))

    agent = agent_mod.ShapesAgent(max_tokens=64)
    with ForcedOutput(rollout_engine, lambda seq: pick(seq)):
        trajs = engine.rollout_batch(data, workflow=agent, group_size=2)
    assert len(trajs) == 2  # one per item, the group's 2 episodes x 2 turns as rows
    for t in trajs:
        assert t["input_ids"].shape[0] == 4 and torch.all(t["rewards"] >= 0)
        assert t["multi_modal_input"][0]["pixel_values"] is not None and len(t["multi_modal_input"]) == 4

    # Bad agents: each ends its own episode; recorded completions stay (reward 0), none -> rejected.
    with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode("ok")):
        for bad, kept, why in ((_RaisesAfterOneCall(), 1, "RuntimeError: the agent's environment crashed"),
                               (_OverflowsTheContext(), 1, "maximum context length is 1024 tokens"),
                               (_BadReward(), 1, "must return a float"),
                               (_NoCompletion(), 0, "made no chat completion"),
                               (UnslothAgentWorkflow(_Hangs(), lambda: engine.agent_server, timeout_s=2.0), 1,
                                "ran past 2.0 s")):
            with captured(agent_server.logger, logging.WARNING) as logged:
                out = engine.rollout_batch([{"i": 0}], workflow=bad)
            assert len(out) == kept
            if kept:
                assert out[0]["rewards"].tolist() == [0.0] and out[0]["loss_mask"].sum() > 0
            assert any(why in m for m in logged), logged

    # Malformed tool-call text and an unknown tool: the agent's own rules give reward 0; the run goes on.
    for text in ('<tool_call>\n{"name": "count", "arguments": {broken}\n</tool_call>',
                 '<tool_call>\n{"name": "rotate", "arguments": {"angle": 90}}\n</tool_call>'):
        with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(text)):
            (t,) = engine.rollout_batch(data[:1], workflow=agent)
        assert t["rewards"].tolist() == [0.0]
    with ForcedOutput(rollout_engine, lambda seq: pick(seq)):
        (t,) = engine.rollout_batch(data[:1], workflow=agent)
    assert t["rewards"].tolist() == [1.0, 1.0]


def test_streaming_agent_is_recorded_and_subproc_mode_runs(engine, rollout_engine):
    """An agent that streams gets the recorded completion replayed as SSE chunks (tool calls included); an
    agent in ``subproc`` mode (OPENAI_BASE_URL / OPENAI_API_KEY in a worker process) is served the same way."""
    from openai import AsyncOpenAI

    from unsloth_rollout.areal.agent_server import AgentServer, UnslothAgentWorkflow

    server = AgentServer(rollout_engine, tool_call_parser="qwen")
    try:
        session = server.start_session()

        async def stream():
            client = AsyncOpenAI(base_url=server.base_url, api_key=session.key, max_retries=0)
            chunks = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "go"}],
                                                          tools=TOOLS, max_tokens=64, stream=True)
            calls, finish = [], None
            async for ch in chunks:
                for c in ch.choices:
                    calls += c.delta.tool_calls or []
                    finish = c.finish_reason or finish
            return calls, finish

        with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode(_count_call("blue"))):
            calls, finish = asyncio.run(stream())
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("count", {"color": "blue"})]
        assert finish == "tool_calls"
        (inter,) = server.end_session(session.key).cache.values()
        assert _calls(inter.completion.choices[0].message.tool_calls) == [("count", {"color": "blue"})]

        agent_mod, env = _example()
        wf = UnslothAgentWorkflow(agent_mod.ShapesAgent(max_tokens=8), server, mode="subproc")
        with ForcedOutput(rollout_engine, rollout_engine.tokenizer.encode("4")):
            out = asyncio.run(wf.arun_episode(engine, {"scene_seed": 5, "color": "green"}))
        (inter,) = out.values()
        want = agent_mod.answer_reward("4", env.Scene(5).answer("green"))
        assert inter.reward == want and inter.model_response.output_tokens[:-1] == rollout_engine.tokenizer.encode("4")
    finally:
        server.close()


def test_session_requests_run_on_the_adapter_the_trainer_serves(rollout_engine, tmp_path):
    """Without colocation a trainer ships versioned LoRA adapters; a session's requests run on the one the
    engine serves now, whatever model name the agent sends."""
    import httpx

    from unsloth_rollout.areal.agent_server import AgentServer

    policy = rollout_engine.policy
    policy.model.save_pretrained(str(tmp_path / "v1"))
    rollout_engine.load_lora_adapter("policy-v1", str(tmp_path / "v1"))
    current = {"name": "policy-v1"}
    server = AgentServer(rollout_engine, served_adapter=lambda: current["name"])
    try:
        session = server.start_session()
        body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True}
        r = httpx.post(server.base_url + "/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {session.key}"}, timeout=60)
        assert r.status_code == 200, r.text
        current["name"] = "policy-v2"  # not loaded: the request names it, the server refuses
        r = httpx.post(server.base_url + "/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {session.key}"}, timeout=60)
        assert r.status_code == 404 and "policy-v2" in r.json()["error"]["message"]
        (inter,) = server.end_session(session.key).cache.values()
    finally:
        server.close()
        rollout_engine.unload_lora_adapter("policy-v1")
    assert inter.completion.model == "policy-v1"


def test_concat_session_exports_one_trajectory_per_conversation(engine, rollout_engine, policy):
    """agent.chat_template_type / export_style "concat": each turn continues the previous turn's exact tokens;
    the episode is one trajectory whose logprobs (3 turns, a picture in turn 1 and a zoomed one from the tool)
    match a teacher-forced forward over the whole conversation with the processor's pixels."""
    from unsloth_rollout.areal.agent_server import AgentServer, UnslothAgentWorkflow

    agent_mod, env = _example()
    scene = env.Scene(9)
    script = [ZOOM_CALL, _count_call("blue"), f"{scene.answer('blue')}"]
    server = AgentServer(rollout_engine, chat_template_type="concat")
    try:
        with pytest.raises(ValueError, match="chat_template_type 'concat'"):  # an "hf" server cannot export concat
            _check_concat_needs_concat_server(rollout_engine, agent_mod)
        wf = UnslothAgentWorkflow(agent_mod.ShapesAgent(max_tokens=64), server, export_style="concat")
        with _by_turn(rollout_engine, script):
            out = asyncio.run(wf.arun_episode(engine, {"scene_seed": 9, "color": "blue"}))
    finally:
        server.close()
    (traj,) = [v.to_tensor_dict() for v in out.values()]
    assert traj["rewards"].tolist() == [1.0]
    mask = traj["loss_mask"][0].bool()
    assert int((mask[1:] & ~mask[:-1]).sum()) + int(mask[0]) == 3  # three assistant turns, one sequence
    images = [scene.image()]
    zoomed = env.Scene(9)
    images.append(zoomed.call("zoom", {"region": "top"}))
    oracle_lp, enc = _oracle(policy, traj, images)
    assert torch.equal(traj["multi_modal_input"][0]["pixel_values"], enc["pixel_values"])
    assert (traj["logprobs"][0][mask] - oracle_lp[mask]).abs().max().item() < 1e-5


def _check_concat_needs_concat_server(rollout_engine, agent_mod):
    from unsloth_rollout.areal.agent_server import AgentServer, UnslothAgentWorkflow

    hf = AgentServer(rollout_engine)
    try:
        UnslothAgentWorkflow(agent_mod.ShapesAgent(), hf, export_style="concat").server
    finally:
        hf.close()
