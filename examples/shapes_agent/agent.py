"""A multi-turn tool-calling VLM agent written with nothing but the ``openai`` SDK.

It knows nothing about AReaL or unsloth_rollout: it gets ``base_url`` / ``api_key`` (and maybe an
``http_client``) and returns its reward. The same class runs against vLLM, the project's server, or, under
``PPOTrainer`` with ``rollout.backend: "unsloth:d1"``, the engine being trained.

Example (against any OpenAI-compatible server)::

    reward = asyncio.run(ShapesAgent().run({"scene_seed": 3, "color": "red"},
                                           base_url="http://127.0.0.1:8000/v1", api_key="x"))
"""

from __future__ import annotations

import json
import re

from openai import AsyncOpenAI

try:  # run as a package (examples.shapes_agent) or from this folder
    from .env import TOOLS, Scene, ToolError, data_url
except ImportError:
    from env import TOOLS, Scene, ToolError, data_url

SYSTEM = "You answer questions about pictures of colored shapes. Use the tools when they help."


def answer_reward(text: str | None, answer: int) -> float:
    """1.0 for the right count; 0.2 for a wrong number (the answer has the asked-for form); 0 without a number."""
    m = re.search(r"\d+", text or "")
    if m is None:
        return 0.0
    return 1.0 if int(m.group()) == answer else 0.2


class ShapesAgent:
    """Ask, run the model's tool calls (``count`` -> text, ``zoom`` -> an image), until it answers.

    Args:
        max_turns: model calls per episode (no answer by then: reward 0).
        max_tokens: tokens per model reply.
        image_size: the scene's side in pixels.
        temperature: sampling temperature of every call.
    """

    def __init__(self, max_turns: int = 3, max_tokens: int = 48, image_size: int = 112, temperature: float = 1.0):
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.image_size = image_size
        self.temperature = temperature

    async def run(self, data: dict, **extra_kwargs) -> float:
        client = AsyncOpenAI(base_url=extra_kwargs.get("base_url"), api_key=extra_kwargs.get("api_key"),
                             http_client=extra_kwargs.get("http_client"), max_retries=0)
        scene = Scene(int(data["scene_seed"]), self.image_size)
        color = data["color"]
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(scene.image())}},
                                                 {"type": "text", "text": scene.question(color)}]}]
        for _ in range(self.max_turns):
            completion = await client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=self.max_tokens,
                temperature=self.temperature)
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:  # a final answer (malformed tool-call text lands here too)
                return answer_reward(message.content, scene.answer(color))
            for call in message.tool_calls:
                try:
                    result = scene.call(call.function.name, json.loads(call.function.arguments))
                except (ToolError, json.JSONDecodeError):
                    return 0.0  # an unknown tool or bad arguments end the episode
                content = result if isinstance(result, str) else [
                    {"type": "image_url", "image_url": {"url": data_url(result)}},
                    {"type": "text", "text": f"the {call.function.name} view"}]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
        return 0.0
