"""Quick start: TRL's GRPOTrainer sampling through the engine (README.md, "TRL GRPOTrainer").

One added argument, ``rollout_func=rollout_func()``: TRL's GRPOTrainer then samples every group through the
rollout engine, from the very model object it trains (vision-tower LoRA included), and gets the engine's
behaviour logprobs for its importance-sampling correction. As is, it runs in seconds on CPU on an offline tiny
random Qwen2.5-VL; on a GPU, set ``UNSLOTH_ROLLOUT_MODEL`` (the README shows ``unsloth/Qwen2.5-VL-3B-Instruct``):

    python examples/quickstart_trl.py

The lines between the ``quickstart`` markers are the README's snippet (``tests/test_quickstarts.py`` checks it).
"""

import os

from unsloth_rollout.testing.tiny import tiny_model_path

# [quickstart]
from datasets import Dataset
from PIL import Image
from trl import GRPOConfig, GRPOTrainer
from unsloth_rollout import load_model
from unsloth_rollout.trl import rollout_func

MODEL = os.environ.get("UNSLOTH_ROLLOUT_MODEL") or str(tiny_model_path("qwen2_5_vl"))
policy = load_model(MODEL, lora={"r": 16, "finetune_vision_layers": True})
data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What colour is it?"}]] * 16,
                          "image": [Image.new("RGB", (224, 224), c) for c in ("red", "blue") * 8]})
def brevity(completions, **kwargs): return [-len(c[0]["content"]) / 100 for c in completions]  # your verifier
args = GRPOConfig(num_generations=8, max_completion_length=32, max_steps=2, bf16=policy.device.type == "cuda")
trainer = GRPOTrainer(model=policy.model, processing_class=policy.processor, reward_funcs=[brevity],
                      train_dataset=data, args=args, rollout_func=rollout_func())  # <- generation via the engine
trainer.train()
# [/quickstart]
