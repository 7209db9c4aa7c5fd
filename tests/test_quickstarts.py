"""The README's four quick starts are files CI runs (``examples/quickstart_*``), and the README shows their code.

Each quick start runs as shipped on an offline tiny random Qwen2.5-VL and is held to an oracle outside the engine:
the Python API's and the server's logprobs to a teacher-forced forward, TRL's run to TRL's own recomputed logprobs
(``sampling/sampling_logp_difference``), AReaL's to AReaL's own recompute (``compute_logp/kl_div_direct``). The
README's snippet for each is the file's marked region (``# [quickstart]`` ... ``# [/quickstart]``), line for line,
except the one line that names the model or the server (a GPU user's id there, the tiny model here); for AReaL
the README's YAML is a subset of ``examples/quickstart_areal.yaml``, key for key, and its launch command is the
one run here.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import re
import runpy
import shlex
import textwrap

import pytest
import torch

from unsloth_rollout.testing.differential_checks import TOL
from unsloth_rollout.testing.oracles import teacher_forced

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MAX_LINES = 15  # a quick start in the README, all its blocks together
# The lines a README snippet may write differently from its file: the model a GPU user names, the server's URL.
LOCAL_LINES = ("MODEL = ", "BASE_URL = ")
MARKER = re.compile(r"<!-- quickstart: (\S+) -->")
FENCE = re.compile(r"\s*^```(\w*)\n(.*?)^```[ \t]*$", re.S | re.M)


def readme_quickstarts(text: str) -> dict[str, list[tuple[str, str]]]:
    """{file: [(language, code), ...]}: the fenced blocks that directly follow each ``<!-- quickstart: FILE -->``
    marker (only blank lines between them)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for m in MARKER.finditer(text):
        blocks, pos = [], m.end()
        while (f := FENCE.match(text, pos)) is not None:
            blocks.append((f.group(1), f.group(2)))
            pos = f.end()
        out[m.group(1)] = blocks
    return out


def marked_region(source: str) -> str:
    """The lines between ``# [quickstart]`` and ``# [/quickstart]``, dedented."""
    m = re.search(r"^[ \t]*# \[quickstart\]\n(.*?)^[ \t]*# \[/quickstart\]", source, re.S | re.M)
    assert m, "no '# [quickstart]' ... '# [/quickstart]' region"
    return textwrap.dedent(m.group(1))


def snippet_differences(readme_code: str, region: str) -> list[str]:
    """What keeps a README snippet from being its file's region: every differing line, unless it is one of the
    ``LOCAL_LINES`` on both sides."""
    a, b = readme_code.rstrip("\n").split("\n"), region.rstrip("\n").split("\n")
    if len(a) != len(b):
        return [f"README has {len(a)} lines, the file's region {len(b)}"]
    return [f"README: {x!r}\nfile:   {y!r}" for x, y in zip(a, b)
            if x != y and not (x.startswith(LOCAL_LINES) and y.startswith(LOCAL_LINES) and x[:6] == y[:6])]


def yaml_subset_differences(part, whole, path="") -> list[str]:
    """Keys of ``part`` (the README's YAML) missing from ``whole`` (the file's) or with another value; the model
    path (``actor.path``) may differ."""
    if isinstance(part, dict):
        if not isinstance(whole, dict):
            return [f"{path}: a mapping in the README, {whole!r} in the file"]
        out = []
        for k, v in part.items():
            key = f"{path}.{k}" if path else str(k)
            if k not in whole:
                out.append(f"{key}: not in the file")
            elif key != "actor.path":
                out += yaml_subset_differences(v, whole[k], key)
        return out
    return [] if part == whole else [f"{path}: {part!r} in the README, {whole!r} in the file"]


@pytest.fixture(scope="module")
def quickstarts():
    return readme_quickstarts((ROOT / "README.md").read_text())


def _code_lines(blocks) -> int:
    return sum(len(code.rstrip("\n").split("\n")) for _, code in blocks)


# ---------------------------------------------------------------------------------------- the README is the files


@pytest.mark.parametrize("name", ["quickstart_python.py", "quickstart_trl.py", "quickstart_server.py"])
def test_readme_snippet_is_the_files_code(quickstarts, name):
    blocks = quickstarts.get(f"examples/{name}")
    assert blocks, f"README.md has no '<!-- quickstart: examples/{name} -->' block"
    python = [code for lang, code in blocks if lang == "python"]
    assert len(python) == 1
    assert snippet_differences(python[0], marked_region((EXAMPLES / name).read_text())) == []
    assert _code_lines(blocks) <= MAX_LINES


def test_readme_areal_snippet_is_the_config_and_its_launch_command(quickstarts):
    import yaml

    blocks = quickstarts.get("examples/quickstart_areal.yaml")
    assert blocks, "README.md has no '<!-- quickstart: examples/quickstart_areal.yaml -->' block"
    (config,) = [code for lang, code in blocks if lang == "yaml"]
    (launch,) = [code for lang, code in blocks if lang == "bash"]
    whole = yaml.safe_load((EXAMPLES / "quickstart_areal.yaml").read_text())
    assert yaml_subset_differences(yaml.safe_load(config), whole) == []
    assert shlex.split(launch.strip()) == AREAL_LAUNCH
    assert _code_lines(blocks) <= MAX_LINES


def test_the_snippet_checks_catch_drift():
    """The checks above fail on a snippet that drifted from its file (a changed argument, a dropped line, another
    YAML value), and pass on the one allowed difference."""
    region = 'MODEL = os.environ.get("M") or "tiny"\npolicy = load_model(MODEL, lora={"r": 16})\nengine.set_version(1)\n'
    readme = 'MODEL = "unsloth/Qwen2.5-VL-3B-Instruct"\npolicy = load_model(MODEL, lora={"r": 16})\nengine.set_version(1)\n'
    assert snippet_differences(readme, region) == []
    assert snippet_differences(readme.replace('"r": 16', '"r": 8'), region)
    assert snippet_differences(readme.replace("engine.set_version(1)\n", ""), region)
    assert snippet_differences(readme.replace("MODEL = ", "BASE_URL = "), region)
    whole = {"rollout": {"backend": "unsloth:d1", "x": 1}, "actor": {"path": "tiny:qwen2_5_vl", "lora_rank": 16}}
    assert yaml_subset_differences({"rollout": {"backend": "unsloth:d1"}, "actor": {"path": "org/model"}}, whole) == []
    assert yaml_subset_differences({"rollout": {"backend": "unsloth:d2"}}, whole)
    assert yaml_subset_differences({"actor": {"lora_rank": 16, "use_lora": True}}, whole)
    assert readme_quickstarts("x\n<!-- quickstart: a.py -->\n```python\nA\n# c\n```\n\n```bash\nB\n```\nprose\n"
                              "```python\nC\n```\n") == {"a.py": [("python", "A\n# c\n"), ("bash", "B\n")]}


# ------------------------------------------------------------------------------------------- the files run


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(name: str, **env) -> dict:
    with _env(UNSLOTH_ROLLOUT_MODEL=None, **env), contextlib.redirect_stdout(io.StringIO()):
        return runpy.run_path(str(EXAMPLES / name), run_name="__main__")


@pytest.fixture(scope="module")
def python_quickstart():
    """examples/quickstart_python.py run as shipped; its engine is shut down at the end of the module."""
    g = _run("quickstart_python.py")
    yield g
    g["engine"].shutdown()


def test_python_quickstart_samples_the_group_with_the_trainers_logprobs(python_quickstart):
    from unsloth_rollout import GenerationRequest, SamplingParams

    g = python_quickstart
    policy, engine, outputs = g["policy"], g["engine"], g["outputs"]
    assert len(outputs) == 8 and all(o.error is None and o.output_ids for o in outputs)
    assert len({tuple(o.prompt_ids) for o in outputs}) == 1 and policy.config.image_token_id in outputs[0].prompt_ids
    for o in outputs:  # the oracle: one plain forward of the same model over prompt + output, with its pixels
        want, _ = teacher_forced(policy, o.prompt_ids, o.output_ids, 1.0, pixel_values=o.pixel_values,
                                 image_grid_thw=o.image_grid_thw)
        assert (torch.tensor(o.output_logprobs) - want).abs().max().item() <= TOL
        assert o.output_versions == [0] * len(o.output_ids)
    after = engine.generate([GenerationRequest(input_ids=outputs[0].prompt_ids[:8],
                                               sampling=SamplingParams(max_new_tokens=2, temperature=0))])
    assert engine.version == 1 and after[0].output_versions == [1, 1]  # set_version stamps what follows


@pytest.fixture(scope="module")
def served(python_quickstart):
    """``create_app`` over the Python quick start's engine (the engine the ``serve`` command builds, without
    loading the model again), on a free local port; yields the base URL."""
    for package in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(package)
    from unsloth_rollout.serve import create_app
    from unsloth_rollout.serve.app import serve_in_thread
    from unsloth_rollout.testing.server import free_port

    port = free_port()
    server = serve_in_thread(create_app(python_quickstart["engine"], served_model_name="policy"), port=port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    server.thread.join(timeout=30)


def test_server_quickstart_calls_the_tool_with_the_trainers_logprobs(python_quickstart, served):
    """The forced tool call parses and validates, and its logprobs equal a teacher-forced forward over the tokens
    the server sampled (seeded: a replay with ``return_token_ids`` gets the same tokens)."""
    jsonschema = pytest.importorskip("jsonschema")
    import numpy as np
    from openai import OpenAI

    policy = python_quickstart["policy"]
    g = _run("quickstart_server.py", BASE_URL=served + "/v1")
    r, zoom = g["r"], g["zoom"]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "zoom"
    jsonschema.validate(json.loads(call.function.arguments), zoom["function"]["parameters"])
    got = [t.logprob for t in choice.logprobs.content]
    replay = OpenAI(base_url=served + "/v1", api_key="unused").chat.completions.create(
        model="policy", max_tokens=64, seed=0, messages=[{"role": "user", "content": [
            g["image"], {"type": "text", "text": "Which side is red?"}]}], tools=[zoom], tool_choice="required",
        parallel_tool_calls=False, logprobs=True, extra_body={"return_token_ids": True}).model_dump()
    assert [t["logprob"] for t in replay["choices"][0]["logprobs"]["content"]] == got
    ids, out = replay["prompt_token_ids"], replay["choices"][0]["token_ids"]
    assert len(out) == len(got)
    image = g["Image"].open(io.BytesIO(g["png"].getvalue())).convert("RGB")
    vision = policy.processor.image_processor(images=[np.asarray(image)], return_tensors="pt")
    want, _ = teacher_forced(policy, ids, out, 1.0, pixel_values=vision["pixel_values"],
                             image_grid_thw=vision["image_grid_thw"])
    assert (torch.tensor(got) - want).abs().max().item() <= TOL


def test_server_manual_examples_run(served, monkeypatch):
    """docs/server.md's client examples (its "Routes" section) run against the server, in order, as written (those
    that need an adapter folder, a checkpoint or a TRL trainer are left out), and every HTTP call they make succeeds
    (the ``openai`` client raises on an error by itself; ``httpx`` calls are made to)."""
    import httpx

    def checked(call):
        def wrapper(*args, **kwargs):
            response = call(*args, **kwargs)
            response.raise_for_status()
            return response
        return wrapper

    monkeypatch.setattr(httpx, "get", checked(httpx.get))
    monkeypatch.setattr(httpx, "post", checked(httpx.post))
    text = (ROOT / "docs" / "server.md").read_text()
    text = text.split("\n## Routes, with a client example each\n", 1)[1].split("\n## ", 1)[0]
    blocks = [m.group(2) for m in FENCE.finditer(text) if m.group(1) == "python"]
    runnable = [b for b in blocks if "ckpt/" not in b and "GRPOConfig" not in b]
    assert blocks[0].startswith("import httpx") and 'B = "http://127.0.0.1:8000"' in blocks[0]
    assert len(runnable) >= 6
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for code in runnable:
            exec(compile(code.replace('B = "http://127.0.0.1:8000"', f'B = "{served}"'), "docs/server.md", "exec"),
                 namespace)


@pytest.mark.trl
def test_trl_quickstart_trains_on_the_engines_samples(tmp_path, monkeypatch):
    """Two GRPO steps; TRL's own recompute of each sampled token's logprob (its importance-sampling check) is
    within fp32 noise of the engine's, and step 2 sampled from the weights step 1 updated in place."""
    pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)  # TRL writes its output_dir under the working directory
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    g = _run("quickstart_trl.py")
    trainer, policy = g["trainer"], g["policy"]
    rollout = trainer.rollout_func
    try:
        assert trainer.state.global_step == 2
        assert rollout.engine.policy.model is policy.model  # one model object: the one TRL trained
        assert [h["versions"] for h in rollout.history] == [[0], [1]]
        logged = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
        assert logged and max(h["sampling/sampling_logp_difference/max"] for h in logged) <= TOL
    finally:
        rollout.engine.shutdown()


AREAL_LAUNCH = ["python", "-m", "unsloth_rollout.areal.grpo", "--config", "examples/quickstart_areal.yaml"]


@pytest.mark.areal
def test_areal_quickstart_trains_with_the_engine_as_areals_inference_engine(tmp_path, monkeypatch):
    """The README's launch command, run in process for one step: AReaL's recompute of the behaviour logprobs
    (``compute_logp/kl_div_direct`` = recomputed - engine's, per token) is within fp32 noise, and the step's
    weight update reached the engine as a version."""
    pytest.importorskip("areal")
    from unsloth_rollout.areal.grpo import main

    monkeypatch.chdir(ROOT)
    history = main(AREAL_LAUNCH[3:] + ["total_train_steps=1", f"cluster.fileroot={tmp_path}/exp",
                                       f"cluster.name_resolve.nfs_record_root={tmp_path}/nr"])
    (step,) = history
    key = "ppo_actor/update/compute_logp/kl_div_direct/"
    assert step[key.replace("kl_div_direct/", "n_valid_tokens")] > 0
    assert max(abs(step[key + "max"]), abs(step[key + "min"])) <= TOL
    assert step["unsloth_rollout/errors"] == 0 and step["unsloth_rollout/finished"] == 32
    assert step["unsloth_rollout/version"] == 1
