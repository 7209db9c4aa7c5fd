"""The bitwise on-policy mode through the server (``unsloth-rollout serve --bitwise``), as AReaL's remote engine uses
it: the trainer runs in its own process on its own copy of the weights.

Oracle: the trainer's recompute on a second model loaded from the same folder (not the served object), one padded
batch forward under ``bitwise.mode`` (``testing.bitwise.trainer_logprobs``): the logprobs SGLang's ``/generate``
returns must equal it bit for bit over a mixed-length batch at two temperatures, before and after
``/update_weights_from_disk`` (the trainer then loads the new checkpoint). The same recompute without the mode
differs in the last bits (the test's own check that it can fail).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from starlette.testclient import TestClient  # noqa: E402

from unsloth_rollout import bitwise, load_model  # noqa: E402
from unsloth_rollout.kernels import batch_invariant  # noqa: E402
from unsloth_rollout.serve.cli import add_serve_arguments, build_app  # noqa: E402
from unsloth_rollout.testing.bitwise import trainer_logprobs, unequal  # noqa: E402
from unsloth_rollout.testing.fixtures import perturbed_checkpoint  # noqa: E402
from unsloth_rollout.testing.tiny import tiny_model_path  # noqa: E402

pytestmark = pytest.mark.skipif(not batch_invariant.available(), reason="no C++ compiler for the mode's kernels")


def _args(*extra: str) -> argparse.Namespace:
    return add_serve_arguments(argparse.ArgumentParser()).parse_args(
        [str(tiny_model_path("qwen2")), "--model-backend", "transformers", "--max-model-len", "256",
         "--kv-cache-memory-bytes", "8MiB", *extra])


def _next_checkpoint(out) -> str:
    """The tiny model with seeded noise on one decoder layer, saved with its tokenizer: a trainer's next step."""
    from transformers import AutoModelForCausalLM

    return str(perturbed_checkpoint(str(tiny_model_path("qwen2")), out, AutoModelForCausalLM, "layers.1.",
                                    with_tokenizer=True))


def _generate(client, prompts):
    """A mixed-length batch at two temperatures through SGLang's /generate: (outputs, their temperatures)."""
    outs, temps = [], []
    for temperature in (1.0, 0.7):
        r = client.post("/generate", json={
            "input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 9, "temperature": temperature, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        for prompt, item in zip(prompts, r.json()):
            lps = item["meta_info"]["output_token_logprobs"]
            assert [t for _, t, _ in lps] == item["output_ids"] and len(lps) == 9
            outs.append(SimpleNamespace(prompt_ids=prompt, output_ids=item["output_ids"],
                                        output_logprobs=[lp for lp, _, _ in lps]))
            temps.append(temperature)
    return outs, temps


def _recompute_equals(path, outs, temps) -> None:
    trainer = load_model(path, backend="transformers")
    bitwise.enable(trainer)
    assert unequal(outs, trainer_logprobs(trainer, outs, temps)) == []
    assert unequal(outs, trainer_logprobs(trainer, outs, temps, on=False))  # the comparison can fail


def test_served_logprobs_equal_a_separate_trainers_recompute_before_and_after_an_update(tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 700, (n,), generator=g).tolist() for n in (5, 17, 11, 3)]
    ckpt = _next_checkpoint(tmp_path / "step-1")
    with TestClient(build_app(_args("--bitwise", "--seed", "0"))) as client:
        assert client.get("/server_info").json()["bitwise"] is True
        before = _generate(client, prompts)
        r = client.post("/update_weights_from_disk", json={"model_path": ckpt})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        after = _generate(client, prompts)
    assert [o.output_logprobs for o in before[0]] != [o.output_logprobs for o in after[0]]
    _recompute_equals(str(tiny_model_path("qwen2")), *before)
    _recompute_equals(ckpt, *after)


def test_a_model_the_mode_cannot_run_is_refused_at_start_naming_the_flag():
    with pytest.raises(SystemExit, match="--bitwise: .*float32"):
        build_app(_args("--bitwise", "--dtype", "bfloat16"))
    with TestClient(build_app(_args())) as client:
        assert client.get("/server_info").json()["bitwise"] is False
