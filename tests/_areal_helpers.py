"""Shared helpers of the test_areal_* files: the teacher-forced oracle and small VLM inputs."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch

from unsloth_rollout.testing.oracles import teacher_forced

IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"


def teacher_forced_logprobs(policy, prompt_ids, output_ids, temperature: float, pixel_values=None,
                            image_grid_thw=None) -> torch.Tensor:
    """The oracle: one plain HF forward of prompt + output; ``log_softmax(logits / T)`` of each output token."""
    return teacher_forced(policy, prompt_ids, output_ids, temperature, pixel_values=pixel_values,
                          image_grid_thw=image_grid_thw)[0]


def random_image(seed: int, size: int = 56):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((size, size, 3)) * 255).astype("uint8"))


def png_data_url(seed: int, size: int = 56) -> str:
    buf = io.BytesIO()
    random_image(seed, size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def vlm_item(policy, i: int) -> dict:
    """A VisionRLVRWorkflow data item: chat-templated text with one image placeholder, plus the image."""
    text = policy.tokenizer.apply_chat_template([{"role": "user", "content": IMAGE_TOKEN + f"What is shape {i}?"}],
                                                tokenize=False, add_generation_prompt=True)
    return {"messages": text, "images": [random_image(100 + i)]}


class ForcedOutput:
    """A fixed-output double at the sampler level: every sequence emits ``ids`` then EOS.

    It wraps the engine's real Sampler: the sampler runs as usual, then each row's token is replaced by
    the scripted one (by the row's output position) and its logprob by the model's own
    ``log_softmax(logits / T)`` of that token, so everything past the sampler (stop checks,
    detokenization, logprobs, versions, the server and ArealOpenAI) runs unchanged, as if the model had
    sampled the script. Use as a context manager.
    """

    def __init__(self, rollout_engine, ids):
        """``ids``: the token ids to emit, or ``ids(seq) -> token ids`` choosing per sequence (by its prompt)."""
        self.engine = rollout_engine
        self.inner = rollout_engine.core.sampler
        self.script = ids if callable(ids) else (lambda seq, ids=list(ids): ids)
        eos = rollout_engine.tokenizer.eos_token_id  # the chat turn's end (<|im_end|>), as a chat model ends
        self.eos = eos if eos is not None else rollout_engine.eos_ids[0]

    def __call__(self, logits, seqs):
        res = self.inner(logits, seqs)
        temps = torch.tensor([s.sampling.logprob_temperature for s in seqs], device=logits.device).unsqueeze(1)
        raw = torch.log_softmax(logits.float() / temps, dim=-1)
        for i, s in enumerate(seqs):
            n = len(s.output_ids)
            ids = self.script(s)
            t = ids[n] if n < len(ids) else self.eos
            res.tokens[i] = t
            res.logprobs[i] = float(raw[i, t])
        return res

    def __enter__(self):
        self.engine.core.sampler = self  # the core samples each step
        return self

    def __exit__(self, *exc):
        self.engine.core.sampler = self.inner
