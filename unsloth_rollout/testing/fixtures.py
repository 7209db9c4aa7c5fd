"""Fixture factories for test modules: each returns a module-scoped pytest fixture (one model load per module),
so test files share setups without sharing a conftest.

Example::

    model_dir = model_copy_fixture("qwen2_5_vl", "tiny")     # a private copy the module may change
    server = server_fixture("--max-model-len", "512")        # the real server on it, a subprocess
    policy = policy_fixture()                                # load_model(model_dir) in process
    engine = engine_fixture(max_model_len=512)               # a RolloutEngine on that policy
"""

from __future__ import annotations

from .server import serve_subprocess


def model_copy_fixture(family: str, size: str = "tiny"):
    """A module-scoped fixture: a freshly built tiny ``family`` model folder of the module's own."""
    import pytest

    @pytest.fixture(scope="module")
    def model_dir(tmp_path_factory):
        from .tiny import build_tiny_model

        return str(build_tiny_model(family, size, out=tmp_path_factory.mktemp(f"{family}_{size}") / "model"))

    return model_dir


def server_fixture(*args: str, model: str = "model_dir", env: dict | None = None):
    """A module-scoped pytest fixture: the real server on the folder the fixture named ``model`` gives, started
    with ``args`` (one per test module: the model loads once), yielding its base URL.

    Example::

        server = server_fixture("--max-model-len", "256", model="qwen2_dir")
    """
    import pytest

    @pytest.fixture(scope="module")
    def server(request, tmp_path_factory):
        log = tmp_path_factory.mktemp("server") / "server.log"
        with serve_subprocess(request.getfixturevalue(model), *args, log_path=log, env=env) as base:
            yield base

    return server


def policy_fixture(model: str = "model_dir"):
    """A module-scoped fixture: ``load_model`` (transformers backend) on the folder the fixture ``model`` gives."""
    import pytest

    @pytest.fixture(scope="module")
    def policy(request):
        from .. import load_model

        return load_model(request.getfixturevalue(model), backend="transformers")

    return policy


def engine_fixture(max_model_len: int, kv_cache_memory_bytes: int = 64 << 20, policy: str = "policy"):
    """A module-scoped fixture: a ``RolloutEngine`` on the fixture ``policy``'s PolicyModel, shut down after."""
    import pytest

    @pytest.fixture(scope="module")
    def engine(request):
        from .. import EngineConfig, RolloutEngine

        eng = RolloutEngine(request.getfixturevalue(policy),
                            EngineConfig(kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len))
        yield eng
        eng.shutdown()

    return engine


def perturbed_checkpoint(model_dir, out, model_class, layer: str, std: float = 0.2, seed: int = 1,
                         with_tokenizer: bool = False):
    """Save a copy of the model at ``model_dir`` (loaded with the transformers auto class ``model_class``) to ``out``
    with seeded noise on the weights whose names contain ``layer``: a "next step" checkpoint whose answers differ
    from the original's, with the tokenizer beside it when ``with_tokenizer`` (for a trainer that loads it whole).
    Returns ``out``."""
    import torch

    model = model_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if layer in name:
                p.add_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out)
    if with_tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def perturbed_vlm_checkpoint(model_dir, out, layer: str = "language_model.layers.1.", std: float = 0.2, seed: int = 1):
    """``perturbed_checkpoint`` of a VLM, noise on one decoder layer."""
    from transformers import AutoModelForImageTextToText

    return perturbed_checkpoint(model_dir, out, AutoModelForImageTextToText, layer, std, seed)
