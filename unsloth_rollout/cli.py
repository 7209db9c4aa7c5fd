"""``unsloth-rollout``: the console entry point; each subcommand lives with its own code.

    unsloth-rollout serve MODEL [options]     # OpenAI/vLLM-compatible server (unsloth_rollout.serve)
"""

from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> None:
    from .serve.cli import run

    run(args)


def build_parser() -> argparse.ArgumentParser:
    from .serve.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog="unsloth-rollout", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over an OpenAI/vLLM-compatible HTTP API")
    add_serve_arguments(serve).set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    args.func(args)


if __name__ == "__main__":
    main()
