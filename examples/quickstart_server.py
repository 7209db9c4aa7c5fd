"""Quick start: the OpenAI/vLLM-compatible server, asked with the ``openai`` client (README.md, "Server").

One chat request with an image, a tool the model must call, and the logprob of every sampled token. Start a
server first and point ``BASE_URL`` at it, e.g. on a GPU:

    unsloth-rollout serve unsloth/Qwen2.5-VL-3B-Instruct --port 8000
    BASE_URL=http://127.0.0.1:8000/v1 python examples/quickstart_server.py

Without ``BASE_URL`` this file starts ``unsloth-rollout serve`` itself on an offline tiny random Qwen2.5-VL on a
free local port (seconds on CPU) and stops it at the end. The lines between the ``quickstart`` markers are the
README's snippet (``tests/test_quickstarts.py`` checks it).
"""

import contextlib
import os
import tempfile

from unsloth_rollout.testing.server import serve_subprocess
from unsloth_rollout.testing.tiny import tiny_model_path

with contextlib.ExitStack() as _stack:
    if not os.environ.get("BASE_URL"):
        _log = os.path.join(_stack.enter_context(tempfile.TemporaryDirectory()), "server.log")
        os.environ["BASE_URL"] = _stack.enter_context(serve_subprocess(tiny_model_path("qwen2_5_vl"), log_path=_log)) + "/v1"
    # [quickstart]
    import base64, io
    from openai import OpenAI
    from PIL import Image
    BASE_URL = os.environ["BASE_URL"]
    png = io.BytesIO(); Image.new("RGB", (224, 224), "red").save(png, "PNG")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()}}
    zoom = {"type": "function", "function": {"name": "zoom", "parameters": {"type": "object",
            "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}}}
    client = OpenAI(base_url=BASE_URL, api_key="unused")
    r = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=64, seed=0,
        messages=[{"role": "user", "content": [image, {"type": "text", "text": "Which side is red?"}]}],
        tools=[zoom], tool_choice="required", parallel_tool_calls=False, logprobs=True)
    call = r.choices[0].message.tool_calls[0]        # parsed from the model's own <tool_call> format
    print(call.function.name, call.function.arguments, [t.logprob for t in r.choices[0].logprobs.content])
    # [/quickstart]
