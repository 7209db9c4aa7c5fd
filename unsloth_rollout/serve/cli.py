"""``unsloth-rollout serve``: load a model, build one RolloutEngine, serve it with uvicorn.

Example::

    unsloth-rollout serve ./qwen2.5-vl-3b --backend auto --max-model-len 8192 \\
        --lora policy=./ckpt/lora-v3 --api-key "$KEY" --port 8000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..logs import get_logger
from ..engine.config import parse_bytes

logger = get_logger("unsloth_rollout.serve")


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model", help="model folder (or hub name when online)")
    g = p.add_argument_group("model")
    g.add_argument("--model-backend", choices=("auto", "unsloth", "transformers"), default="auto",
                   help="load_model backend")
    g.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes NF4 weights")
    g.add_argument("--dtype", default=None, help="torch dtype name (default: fp32 on CPU, bf16 on GPUs that have it)")
    g.add_argument("--device", default=None)
    g.add_argument("--lora", "--lora-modules", dest="lora", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH", help="PEFT adapters to load at start; requests select them by NAME")
    g.add_argument("--enable-runtime-lora", action="store_true", default=None,
                   help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (default: "
                   "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM)")
    g.add_argument("--max-lora-rank", type=int, default=256,
                   help="refuse adapters of a higher LoRA rank (/server_info's lora_config reports it)")
    g.add_argument("--max-loras", type=int, default=None, help="most adapters loaded by name at once (default: no limit)")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion")
    g.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="KV cache budget in bytes, e.g. 1073741824 or 8GiB (default: a fraction of "
                   "free memory)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.3)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--no-prefix-cache", action="store_true")
    g.add_argument("--seed", type=int, default=None, help="sampler seed for requests without their own seed")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("UNSLOTH_ROLLOUT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $UNSLOTH_ROLLOUT_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None, help="name(s) requests use for the model")
    g.add_argument("--allowed-local-media-path", default=None, help="allow image files under this folder")
    g.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image URLs")
    g.add_argument("--max-images-per-request", type=int, default=16)
    g.add_argument("--max-image-pixels", type=int, default=4096 * 4096)
    g.add_argument("--max-n", type=int, default=64, help="largest n per request")
    g.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body")
    g.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "transformers"), default="auto")
    g.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                   help="auto: default sampling parameters from the model's generation_config.json")
    g.add_argument("--logprobs-mode", choices=("raw_logprobs", "processed_logprobs"), default="raw_logprobs",
                   help="raw: log_softmax(logits / T), what a trainer recomputes; processed: the distribution each "
                   "token was drawn from (penalties, top-k/top-p/min-p, renormalised), as vLLM's")
    g.add_argument("--max-logprobs", type=int, default=20, help="largest prompt_logprobs a request may ask")
    g.add_argument("--weight-transfer-config", default=None, metavar="JSON",
                   help='serve vLLM\'s full-weight transfer routes (TRL\'s vllm_mode="server" sync): \'{"backend": '
                   '"gloo"}\'; vLLM\'s "nccl" backend is refused (default: off)')
    g.add_argument("--enable-lora", action="store_true", help="accepted for vLLM command lines: adapters are always on")
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


def build_app(args: argparse.Namespace):
    """Load the model and engine described by ``args`` and return the app (the CLI without uvicorn)."""
    from ..engine import EngineConfig, RolloutEngine
    from ..models import load_model
    from .app import create_app
    from .weight_transfer import parse_weight_transfer_config

    loras = _parse_loras(args.lora)
    try:  # refused before the model loads
        weight_transfer = parse_weight_transfer_config(args.weight_transfer_config)
    except ValueError as e:
        raise SystemExit(f"--weight-transfer-config: {e}") from None
    policy = load_model(args.model, backend=args.model_backend, dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                        max_seq_length=args.max_model_len, device=args.device)
    config = EngineConfig(
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, prefix_cache=not args.no_prefix_cache, max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras)
    engine = RolloutEngine(policy, config, seed=args.seed)
    for name, path in loras:
        engine.load_lora_adapter(name, path)
    return create_app(engine, served_model_name=args.served_model_name or [args.model], api_key=args.api_key,
                      model_path=args.model, allowed_local_media_path=args.allowed_local_media_path,
                      allow_remote_images=args.allow_remote_images,
                      max_images_per_request=args.max_images_per_request, max_image_pixels=args.max_image_pixels,
                      max_n=args.max_n, max_body_bytes=int(args.max_body_mb * (1 << 20)),
                      tool_call_parser=args.tool_call_parser, generation_config=args.generation_config,
                      owns_engine=True, logprobs_mode=args.logprobs_mode, max_logprobs=args.max_logprobs,
                      enable_runtime_lora=args.enable_runtime_lora, weight_transfer_config=weight_transfer)


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
