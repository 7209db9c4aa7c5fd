"""OpenAI/vLLM-compatible HTTP server over one shared RolloutEngine.

Command line::

    unsloth-rollout serve MODEL_DIR --port 8000 [--lora NAME=PATH ...]
    python -m unsloth_rollout.serve MODEL_DIR --port 8000

In process (serve the live policy of a training run)::

    from unsloth_rollout.serve import create_app, serve_in_thread
    server = serve_in_thread(create_app(engine, served_model_name="policy"), port=8000)

Importing ``unsloth_rollout`` does not import this package (nor fastapi); importing this package
imports fastapi only when ``create_app`` is first used.
"""

__all__ = ["create_app", "main", "serve_in_thread"]


def __getattr__(name):
    if name in ("create_app", "serve_in_thread"):
        from . import app

        return getattr(app, name)
    if name == "main":
        from .cli import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
