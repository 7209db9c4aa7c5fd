"""The server's settings, declared once: ``create_app``'s keywords and ``unsloth-rollout serve``'s flags derive
from ``ServerSettings`` (as TRL derives its CLI from one settings dataclass), and ``add_dataclass_arguments``
builds the engine flags from ``EngineConfig``'s own defaults the same way.

Example::

    settings = ServerSettings(max_n=8, api_key="secret")
    parser = add_dataclass_arguments(argparse.ArgumentParser(), ServerSettings)   # --max-n, --api-key, ...
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field

from ..engine.config import LOGPROBS_MODES
from .tools import PARSERS


def _mib(text: str) -> int:
    return int(float(text) * (1 << 20))


def setting(default, help: str, **cli):
    """A settings field: its default, its one-line meaning, and argparse keywords for its flag (``flag``: the flag's
    spelling; ``env``: an environment variable that replaces the default on the command line; ``cli=False``: no
    flag)."""
    return field(default=default, metadata={"help": help, **cli})


@dataclass
class ServerSettings:
    """What one server allows and how it answers; every field is a keyword of ``create_app`` and (but
    ``model_path`` and ``owns_engine``) a flag of ``unsloth-rollout serve``. Each field's ``help`` says what it is."""

    served_model_name: str | list[str] | None = setting(
        None, "name(s) a request's model may use for the policy; the first is reported (default: the model "
        "folder's name); loaded adapters are selected by their own names", nargs="+")
    model_path: str | None = setting(None, "the model folder /v1/models and /server_info report", cli=False)
    api_key: str | None = setting(
        None, "require 'Authorization: Bearer KEY' on every route but /health, /ping, /metrics and /version "
        "(401 otherwise; the command line's default: $UNSLOTH_ROLLOUT_API_KEY)", env="UNSLOTH_ROLLOUT_API_KEY")
    allowed_local_media_path: str | None = setting(None, "images may be read from files under this folder")
    allow_remote_images: bool = setting(False, "fetch http(s) image URLs (otherwise such a request is a 400)")
    max_images_per_request: int = setting(16, "most images in one request (400 above it)")
    max_image_pixels: int = setting(4096 * 4096, "most pixels in one image (400 above it)")
    max_n: int = setting(64, "largest n per request (400 above it)")
    max_body_bytes: int = setting(32 << 20, "largest request body (413 above it; the flag is in MiB)",
                                  flag="--max-body-mb", type=_mib, metavar="MIB")
    tool_call_parser: str = setting("auto", "how tool calls are read from the model's text", choices=PARSERS)
    generation_config: str = setting(
        "auto", "auto: default temperature / top_p / top_k / min_p / repetition_penalty from the model's "
        "generation_config.json (as vLLM does); vllm: ignore it", choices=("auto", "vllm"))
    logprobs_mode: str = setting(
        "raw_logprobs", "raw_logprobs: log_softmax(logits / T), what a trainer recomputes; processed_logprobs: the "
        "distribution each token was drawn from (penalties, top-k / top-p / min-p, renormalised), as vLLM's",
        choices=LOGPROBS_MODES)
    max_logprobs: int = setting(20, "largest prompt_logprobs a request may ask (vLLM's --max-logprobs; -1: no cap, "
                                "as TRL's `trl vllm-serve` command line asks)")
    enable_runtime_lora: bool | None = setting(
        None, "serve /v1/load_lora_adapter and /v1/unload_lora_adapter (404 otherwise, as vLLM); default: "
        "$VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM")
    weight_transfer_config: dict | str | None = setting(
        None, "serve vLLM's full-weight transfer routes (TRL's vllm_mode=\"server\" sync): '{\"backend\": \"nccl\"}' "
        "(vLLM's default; the served model on CUDA) or '{\"backend\": \"gloo\"}' (any device); \"timeout_s\" bounds "
        "each rendezvous and update (default: off, the routes answer 501); create_app checks it "
        "(weight_transfer.parse_weight_transfer_config)", type=str, metavar="JSON")
    owns_engine: bool = setting(False, "shut the engine down when the app stops", cli=False)

    def __post_init__(self):
        for name, allowed in (("logprobs_mode", LOGPROBS_MODES), ("tool_call_parser", PARSERS),
                              ("generation_config", ("auto", "vllm"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no cap) or at least 0, got {self.max_logprobs}")
        if self.enable_runtime_lora is None:
            self.enable_runtime_lora = runtime_lora_from_env()

    def model_names(self, path: str | None) -> list[str]:
        """The names a request's ``model`` may use for the policy loaded from ``path`` (the first is reported)."""
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name or []) or [str(path).rstrip("/").rsplit("/", 1)[-1] if path
                                                      else "unsloth-rollout"]


def runtime_lora_from_env() -> bool:
    """vLLM's switch for loading adapters over HTTP: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1 / true."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def _scalar(hint):
    """(element type, is a list) of a field's type hint, None dropped: ``str | list[str] | None`` -> (str, True)."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    args = [a for a in args if a is not type(None)]
    lists = [typing.get_args(a)[0] for a in args if typing.get_origin(a) is list]
    return (lists[0], True) if lists else (args[0], False)


def add_dataclass_arguments(parser, cls, names=None, options: dict | None = None):
    """Add one flag per field of the dataclass ``cls`` (``names``: only those) to ``parser`` (or an argument group);
    returns ``parser``. The flag is ``--field-name`` (``--no-field-name`` for a field that defaults to True), its
    default the field's own; a field's metadata (see ``setting``) or ``options[name]`` adds argparse keywords."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        kw = {**f.metadata, **(options or {}).get(f.name, {})}
        if kw.pop("cli", True) is False:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        env = kw.pop("env", None)
        if env is not None:
            default = os.environ.get(env, default)
        kind, many = _scalar(hints[f.name])
        flag = kw.pop("flag", None)
        # No default shown for a flag with its own type (it would be in the field's unit) or from the environment.
        shown = "type" not in kw and env is None and default is not None and not isinstance(default, bool)
        if kind is bool:
            kw["action"] = "store_false" if default is True else "store_true"
            flag = flag or ("--no-" if default is True else "--") + f.name.replace("_", "-")
        else:
            kw.setdefault("type", kind)
            if many:
                kw.setdefault("nargs", "+")
            flag = flag or "--" + f.name.replace("_", "-")
        if "help" in kw:  # argparse %-formats help text
            kw["help"] = kw["help"].replace("%", "%%") + (f" (default: {default})" if shown else "")
        parser.add_argument(flag, dest=f.name, default=default, **kw)
    return parser


def from_namespace(cls, args: argparse.Namespace, names=None, **extra):
    """The ``cls`` (a dataclass) that the flags ``add_dataclass_arguments`` added (``names``: only those) hold in
    ``args``, with ``extra`` fields on top."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if hasattr(args, f.name) and (names is None or f.name in names)}
    return cls(**{**values, **extra})
