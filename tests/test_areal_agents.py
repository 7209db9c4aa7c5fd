"""Tool-calling VLM agents on the unsloth backend (issue 13), on the tiny Qwen2.5-VL, CPU, offline.

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

import pytest
import torch

pytest.importorskip("areal")
pytest.importorskip("fastapi")
pytestmark = pytest.mark.areal

from areal.api.cli_args import InferenceEngineConfig  # noqa: E402

from unsloth_rollout import EngineConfig, RolloutEngine, load_model  # noqa: E402
from unsloth_rollout.areal import install  # noqa: E402
from unsloth_rollout.areal.inference_engine import UnslothInferenceEngine  # noqa: E402

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
THINK_HERMES_TEXT = '<think>red first</think><tool_call>\n{"name": "count", "arguments": {"color": "red"}}\n</tool_call>'
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
    e = UnslothInferenceEngine(InferenceEngineConfig(backend="unsloth:d1", consumer_batch_size=2),
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

    assert not external_parsers_installed(), "this test is about an install without sglang / vllm"
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
    c3 = asyncio.run(client.chat.completions.create(messages=messages, tools=TOOLS, max_completion_tokens=12,
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
