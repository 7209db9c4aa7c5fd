"""Quick start: the Python API (README.md, "Python API").

Samples a GRPO group from a LoRA vision-language model, with each token's logprob and the weight version
that produced it. As is, it runs in seconds on CPU on an offline tiny random Qwen2.5-VL; on a GPU, set
``UNSLOTH_ROLLOUT_MODEL`` to a model folder or hub id (the README shows ``unsloth/Qwen2.5-VL-3B-Instruct``):

    python examples/quickstart_python.py
    UNSLOTH_ROLLOUT_MODEL=unsloth/Qwen2.5-VL-3B-Instruct python examples/quickstart_python.py

The lines between the ``quickstart`` markers are the README's snippet (``tests/test_quickstarts.py`` checks it).
"""

import os

from unsloth_rollout.testing.tiny import tiny_model_path

# [quickstart]
from PIL import Image
from unsloth_rollout import GenerationRequest, RolloutEngine, SamplingParams, load_model

MODEL = os.environ.get("UNSLOTH_ROLLOUT_MODEL") or str(tiny_model_path("qwen2_5_vl"))
policy = load_model(MODEL, lora={"r": 16, "finetune_vision_layers": True})  # Unsloth where it can, else HF + PEFT
engine = RolloutEngine(policy)              # KV cache: 30% of free GPU memory (EngineConfig sizes it)

image = Image.new("RGB", (224, 224), "red")
request = GenerationRequest(
    messages=[{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Colour?"}]}],
    sampling=SamplingParams(n=8, max_new_tokens=64, temperature=1.0, seed=0))
outputs = engine.generate([request])        # 8 samples of one prompt: one prefill, decoded together
print(outputs[0].text, outputs[0].output_logprobs[:4], outputs[0].output_versions[:4])
# ... your optimizer step on policy.model: the engine samples from that same object ...
engine.set_version(1)                       # tokens sampled from now on are stamped 1; no weights are copied
# [/quickstart]
