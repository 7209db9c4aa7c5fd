"""``unsloth-rollout serve``: load a model, build one RolloutEngine, serve it with uvicorn.

Example::

    unsloth-rollout serve ./qwen2.5-vl-3b --model-backend auto --max-model-len 8192 \\
        --lora policy=./ckpt/lora-v3 --api-key "$KEY" --port 8000
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..logs import get_logger
from ..engine.config import parse_bytes
from .settings import ServerSettings, add_dataclass_arguments, from_namespace

logger = get_logger("unsloth_rollout.serve")


# EngineConfig fields the command line sets (their defaults are EngineConfig's) and what each flag means.
ENGINE_FLAGS = {
    "max_model_len": "longest prompt + completion (default: the model's max_position_embeddings)",
    "kv_cache_memory_bytes": "KV cache budget in bytes, e.g. 1073741824 or 8GiB (default: a fraction of free memory)",
    "kv_cache_memory_fraction": "that fraction, when no budget is given",
    "max_num_seqs": "most sequences decoding in one step",
    "prefix_cache": "do not share the KV of identical prompt prefixes",
}
# Fields of EngineConfig's nested configs the command line sets, under vLLM's flag names: config -> field -> help.
NESTED_ENGINE_FLAGS = {
    "lora": {"max_lora_rank": "refuse adapters of a higher LoRA rank (/server_info's lora_config reports it)",
             "max_loras": "most adapters loaded by name at once (default: no limit)"},
    "multimodal": {"mm_processor_cache_bytes": "bytes of image-processor outputs kept for repeated images, e.g. "
                                               "4GiB; 0: off (default: 256MiB)"},
}


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` flags: the model's, the engine's (from ``EngineConfig``) and the server's (``ServerSettings``)."""
    from ..engine import EngineConfig
    from ..models.loader import BACKENDS

    p.add_argument("model", help="model folder (or hub name when online)")
    g = p.add_argument_group("model")
    g.add_argument("--model-backend", choices=BACKENDS, default="auto",
                   help="load_model backend")
    g.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 weights")
    g.add_argument("--dtype", default=None, help="torch dtype name (default: fp32 on CPU, bf16 on GPUs that have it)")
    g.add_argument("--device", default=None)
    g.add_argument("--lora", "--lora-modules", dest="lora", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="PEFT adapters to load at start; requests select them by NAME")
    g.add_argument("--enable-lora", action="store_true", help="accepted for vLLM command lines: adapters are always on")
    g.add_argument("--bitwise", action="store_true",
                   help="the bitwise on-policy mode (docs/bitwise.md): every logprob equals a trainer's recompute "
                        "under bitwise.mode bit for bit; float32 on CPU, eager decode")
    g = p.add_argument_group("engine")
    options = {name: {"help": text} for name, text in ENGINE_FLAGS.items()}
    options["kv_cache_memory_bytes"]["type"] = parse_bytes
    add_dataclass_arguments(g, EngineConfig, names=ENGINE_FLAGS, options=options)
    nested = _nested_configs()
    for part, flags in NESTED_ENGINE_FLAGS.items():
        options = {name: {"help": text} for name, text in flags.items()}
        if "mm_processor_cache_bytes" in options:
            options["mm_processor_cache_bytes"]["type"] = parse_bytes
        add_dataclass_arguments(g, nested[part], names=flags, options=options)
    g.add_argument("--mm-processor-cache-gb", type=float, default=None,
                   help="vLLM's spelling of --mm-processor-cache-bytes, in GiB")
    g.add_argument("--seed", type=int, default=None, help="sampler seed for requests without their own seed")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    add_dataclass_arguments(g, ServerSettings)
    g.add_argument("--log-level", default="info")
    return p


def _parse_loras(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora expects NAME=PATH, got {item!r}")
        out.append((name, path))
    return out


def engine_config(args: argparse.Namespace):
    """The EngineConfig the ``serve`` flags describe (vLLM's ``--mm-processor-cache-gb`` overrides the bytes)."""
    from ..engine import EngineConfig

    if args.mm_processor_cache_gb is not None:
        args.mm_processor_cache_bytes = int(args.mm_processor_cache_gb * (1 << 30))
    nested = _nested_configs()
    return from_namespace(EngineConfig, args, names=ENGINE_FLAGS,
                          **{part: from_namespace(nested[part], args, names=flags)
                             for part, flags in NESTED_ENGINE_FLAGS.items()})


def _nested_configs() -> dict:
    from ..engine.config import LoRAConfig, MultiModalConfig

    return {"lora": LoRAConfig, "multimodal": MultiModalConfig}


def build_app(args: argparse.Namespace):
    """Load the model and engine described by ``args`` and return the app (the CLI without uvicorn)."""
    from ..engine import RolloutEngine
    from ..models import load_model
    from .app import create_app
    from .weight_transfer import check_weight_transfer_device, parse_weight_transfer_config

    loras = _parse_loras(args.lora)
    settings = from_namespace(ServerSettings, args, served_model_name=args.served_model_name or [args.model],
                              model_path=args.model, owns_engine=True)
    try:  # refused before the model loads
        transfer = parse_weight_transfer_config(settings.weight_transfer_config)
    except ValueError as e:
        raise SystemExit(f"--weight-transfer-config: {e}") from None
    policy = load_model(args.model, backend=args.model_backend, dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                        max_seq_length=args.max_model_len, device=args.device)
    try:  # and what needs the loaded model (NCCL: on a CUDA device) before the engine starts
        check_weight_transfer_device(transfer, policy)
    except ValueError as e:
        raise SystemExit(f"--weight-transfer-config: {e}") from None
    if args.bitwise:
        from .. import bitwise
        from ..errors import BitwiseModeError

        try:
            bitwise.enable(policy)
        except BitwiseModeError as e:
            raise SystemExit(f"--bitwise: {e}") from None
    engine = RolloutEngine(policy, engine_config(args), seed=args.seed)
    for name, path in loras:
        engine.load_lora_adapter(name, path)
    return create_app(engine, settings)


def run(args: argparse.Namespace) -> None:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(args)
    logger.info("unsloth_rollout: serving %s on http://%s:%d", args.model, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_keep_alive=30)


def main(argv: list[str] | None = None) -> None:
    parser = add_serve_arguments(argparse.ArgumentParser(
        prog="unsloth-rollout serve", description="OpenAI/vLLM-compatible server over an in-process rollout engine"))
    run(parser.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
