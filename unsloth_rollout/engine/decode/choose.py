"""Which decode step runs, and why: the only place that knows every variant.

Two tables. ``choose_backend`` is the engine's ``auto`` (once, at engine start: device, dtype, quantization,
loader, compiler -> variant); ``choose_step`` is every step's (the rows, their adapters and shared prompts, the
workspace budget, hooks -> the variant that runs this step). The defaults the variants take from the model
(layers per compiled call, the shared-prompt threshold, whether shared prompts are served at all) are here too.
A new variant is one module and one row of these tables.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ...errors import BitwiseModeError

HALF_OR_FULL = (torch.float32, torch.float16, torch.bfloat16)


class Parts(NamedTuple):
    """What a variant is built from (the gather step is always there: every step's last fallback)."""

    workspace: bool  # the decode workspace and the eager workspace step over it
    compiled: bool  # the compiled step over the same rows
    graph: bool  # the graph step replaying the compiled step
    paged: bool = False  # the paged step: attention reads the pool in place (decode/paged.py)


# ``DecodeConfig.backend`` values (``auto`` resolves to one of them) and their parts.
PARTS = {
    "gather": Parts(workspace=False, compiled=False, graph=False),
    "workspace": Parts(workspace=True, compiled=False, graph=False),
    "compiled": Parts(workspace=True, compiled=True, graph=False),
    "graph": Parts(workspace=True, compiled=True, graph=True),
    "paged": Parts(workspace=False, compiled=False, graph=False, paged=True),
}
BACKENDS = tuple(PARTS)

# Fewest shared positions for a shared prompt (``DecodeConfig.shared_prompt_min_tokens=None``): 32, also with the
# compiled step on the CPU kernel, which reads shared prompts in the graph; 640 with the compiled step without the
# kernel, whose steps over shared prompts run eager (benchmarks/cpu/shared-prefix-crossover.md has the crossover).
EAGER_MIN_SHARED, COMPILED_MIN_SHARED = 32, 640


@dataclass(frozen=True)
class DecodeFacts:
    """What ``auto`` looks at."""

    device: str  # torch device type: "cpu", "cuda", ...
    dtype: torch.dtype  # the model's compute dtype
    loader: str | None  # who loaded the model: "transformers", "unsloth" (PolicyModel.backend)
    quantized: bool  # 4-bit / 8-bit weights (bitsandbytes or any other quantized linear layer)
    compiler: bool  # a C++ compiler for inductor's CPU code
    workspace_bytes: int | None  # DecodeConfig.workspace_bytes (0: no workspace)
    bitwise: bool = False  # the bitwise on-policy mode (unsloth_rollout/bitwise.py)


def facts_of(policy, device: torch.device, workspace_bytes: int | None, bitwise: bool = False) -> DecodeFacts:
    return DecodeFacts(device.type, getattr(policy, "dtype", torch.float32), getattr(policy, "backend", None),
                       quantized(policy.model), cxx_compiler(), workspace_bytes, bitwise)


def quantized(model) -> bool:
    """bitsandbytes (or any other) quantized linear layers anywhere in the model."""
    return (getattr(getattr(model, "config", None), "quantization_config", None) is not None
            or any("4bit" in type(m).__name__ or "8bit" in type(m).__name__ for m in model.modules()))


def cxx_compiler() -> bool:
    return bool(os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "c++", "clang++")))


def choose_backend(facts: DecodeFacts) -> tuple[str, str]:
    """``auto``: (variant, why). The first row that holds decides."""
    cuda, cpu = facts.device == "cuda", facts.device == "cpu"
    table = [
        (facts.workspace_bytes == 0, "workspace", "no decode workspace (workspace_bytes=0): every step gathers"),
        (facts.bitwise, "workspace", "the bitwise on-policy mode: its batch-invariant ops run in eager steps"),
        (cuda and facts.loader != "transformers", "workspace", "loaded by Unsloth: not measured compiled on a GPU"),
        (cuda and facts.quantized, "workspace", "4-bit weights: not measured compiled on a GPU"),
        (cuda and facts.dtype not in HALF_OR_FULL, "workspace", f"{facts.dtype}: not measured compiled on a GPU"),
        (cuda, "compiled", "transformers + PEFT in full or half precision: measured faster than the eager step "
                           "(benchmarks/gpu/README.md)"),
        (cpu and facts.compiler, "compiled", "a C++ compiler for inductor's CPU code"),
        (cpu, "workspace", "no C++ compiler for inductor's CPU code"),
        (True, "workspace", f"not measured compiled on {facts.device}"),
    ]
    return next((variant, why) for holds, variant, why in table if holds)


def check_bitwise(backend: str, compile_mode: str | None) -> None:
    """Under the bitwise on-policy mode only the eager variants run: a compiled step fuses ops differently from the
    trainer's forward, so asking for one is refused by name (``auto`` picks the eager workspace step)."""
    if backend == "paged":
        raise BitwiseModeError("decode.backend='paged': its attention kernel sums keys in another order than the "
                               "trainer's forward; under the bitwise on-policy mode use 'auto', 'workspace' or "
                               "'gather'")
    if PARTS.get(backend, PARTS["workspace"]).compiled:
        raise BitwiseModeError(f"decode.backend={backend!r}: the compiled decode step fuses ops differently from the "
                               "trainer's forward; under the bitwise on-policy mode use 'auto', 'workspace' or "
                               "'gather'")
    if compile_mode is not None:
        raise BitwiseModeError(f"decode.compile_mode={compile_mode!r}: the bitwise on-policy mode runs eager decode "
                               "steps only")


def layers_per_call(requested: int | None, served_family: bool) -> int:
    """Decoder layers per compiled call: ``requested``, else 4 for a family the registry serves (their decoder loops
    pass each layer its predecessor's output and the same arguments: decode/units.py), else 1."""
    if requested is not None:
        return max(1, int(requested))
    return 4 if served_family else 1


def shared_prompts_served(device: torch.device, inner: str, bitwise: bool = False) -> bool:
    """Whether rows may read shared prompts once per group: on CPU (the split attention uses the CPU flash kernel,
    which returns its log-sum-exp), with SDPA arithmetic, outside the bitwise on-policy mode (its attention reads
    each row's keys in one order, as the trainer's forward does). That every layer attends over all of its history (no
    sliding window, no logit soft-capping) is what the probe's decode then sees (``ModelRunner.probe``)."""
    return device.type == "cpu" and inner in ("sdpa", "fused") and not bitwise


def shared_prompt_min_tokens(requested: int | None, backend: str, kernel: bool) -> int:
    """Fewest shared positions worth a store entry: ``requested``, else 32, or ``COMPILED_MIN_SHARED`` when the
    compiled step runs without the CPU kernel (its steps that read shared prompts run eager)."""
    if requested is not None:
        return requested
    return COMPILED_MIN_SHARED if PARTS[backend].compiled and not kernel else EAGER_MIN_SHARED


def choose_step(*, arranged: bool, compiled: bool, eager: bool, adapters: bool, shared: bool,
                compiled_reads_shared: bool, fits: Callable[[], bool], paged: bool = False) -> str:
    """The variant that runs this step; the first row that holds decides (``fits`` last: it may grow the
    workspace). The graph step, where configured, replays what "compiled" runs, and runs it unrecorded while a
    decoder layer has a hook (decode/graph.py). ``paged``: the configured variant is the paged step, which holds no
    rows and serves every step (the probe's too)."""
    if paged:
        return "paged"
    if not arranged:  # no workspace, or its rows would not fit its byte budget this step
        return "gather"
    if not compiled or eager:  # the eager variant, or a step asked eager (the engine's probe)
        return "workspace"
    if adapters:  # rows naming adapters: PEFT's per-row adapter_names is Python
        return "workspace"
    if shared and not compiled_reads_shared:  # shared prompts without the CPU kernel
        return "workspace"
    if not fits():  # the padded batch would not fit the workspace's budget
        return "workspace"
    return "compiled"
