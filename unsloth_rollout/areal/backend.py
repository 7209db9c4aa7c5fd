"""Where AReaL calls in: the ``unsloth`` backend for ``PPOTrainer``, without editing AReaL's files.

``install()`` does three things, all idempotent:

1. adds ``"unsloth"`` to the inference backends of AReaL's allocation grammar, so
   ``rollout.backend: "unsloth:dN"`` (and ``actor.backend: "unsloth:dN"``) parse, and lets AReaL's SPMD
   launchers size an ``allocation_mode: "unsloth:dN"`` job as N trainer processes;
2. wraps five ``PPOTrainer`` methods so that, when ``rollout.backend`` is unsloth, the trainer builds
   an ``UnslothPPOActor`` (the ColocatedTrainEngine) and ``UnslothInferenceEngine``s on one shared
   PolicyModel in this process: no scheduler, no RPC workers, no server, LoRA allowed, no offload;
   agent workflows (``async def run(data, **extra_kwargs)``) talk to the engine's in-process
   OpenAI-compatible server (``agent_server``) instead of AReaL's proxy workers;
3. makes ``ArealOpenAI`` work without SGLang/vLLM: the project's tool-call parsers where AReaL finds
   none, and the engine's pixel values in its VLM trajectories (``openai_compat``).

Any other backend takes AReaL's own code path (and gets AReaL's own errors).
``patches/areal-1.0.4-unsloth-backend.patch`` makes the same change in AReaL's source; both call the
``create_*`` functions below.

Example::

    from unsloth_rollout.areal import install
    install()
    trainer = PPOTrainer(config, train_dataset=ds)   # config.rollout.backend == "unsloth:d1"
"""

from __future__ import annotations

import functools
import threading
from copy import deepcopy

from . import compat
from ._spec import BACKEND_NAME, is_unsloth_backend
from .openai_compat import patch_openai

_GRAMMAR_OLD = 'INFER_BACKEND: "sglang" | "vllm"'
_GRAMMAR_NEW = 'INFER_BACKEND: "sglang" | "vllm" | "unsloth"'
_TRAIN_BACKENDS = ("unsloth", "fsdp")
_lock = threading.Lock()


# ============================================================================ engine builders (also used by the patch)
def _unsloth_config(trainer):
    from .config import UnslothConfig

    cfg = getattr(trainer.config, "unsloth", None)
    return cfg if cfg is not None else UnslothConfig()


def uses_unsloth(trainer) -> bool:
    """True when this PPOTrainer's ``rollout.backend`` names the unsloth backend."""
    return is_unsloth_backend(getattr(trainer.config.rollout, "backend", None))


def create_train_engine(trainer, actor_config, alloc):
    """The actor (or KL reference) for an unsloth PPOTrainer: an UnslothPPOActor on the shared model.

    With ``unsloth:dN`` (N > 1) this process is one of N replicas: the process group is joined here and
    the model is loaded on this rank's device (``cuda:LOCAL_RANK`` or the CPU); see ``distributed.py``.
    """
    from .train_engine import UnslothPPOActor

    if alloc.backend not in _TRAIN_BACKENDS:
        raise ValueError(f"actor.backend: with rollout.backend 'unsloth:...' the actor trains the rollout's own "
                         f"model in this process; use 'unsloth:dN' (or 'fsdp:dN'), got {alloc.backend!r}")
    ucfg = _unsloth_config(trainer)
    load_options = ucfg.load_options()
    dp = int(alloc.parallel.data_parallel_size)
    if dp > 1:
        from .distributed import DataParallel

        replica = DataParallel.init(dp, timeout_s=getattr(ucfg, "dist_timeout_s", None))
        if replica.device.type == "cuda":
            load_options["device"] = str(replica.device)
    is_ref = actor_config is trainer.config.ref and getattr(trainer, "actor", None) is not None
    if is_ref:
        engine = UnslothPPOActor(actor_config, reference=True, load_options=load_options,
                                 share_with=trainer.actor)
    else:
        engine = UnslothPPOActor(actor_config, load_options=load_options)
    if dp > 1:
        engine.use_replica(replica)
    engine.create_process_group(parallel_strategy=alloc.parallel)
    return engine


def create_rollout(trainer, rollout_config, is_eval: bool = False):
    """An UnslothInferenceEngine on the actor's PolicyModel; the eval engine shares the training
    engine's RolloutEngine (one model, one KV cache) with its own staleness-free executor."""
    from .inference_engine import UnslothInferenceEngine

    config = deepcopy(rollout_config)
    if is_eval:
        config.max_head_offpolicyness = int(1e12)  # as AReaL: eval has no off-policyness control
    shared = None
    if is_eval and isinstance(getattr(trainer, "rollout", None), UnslothInferenceEngine):
        shared = trainer.rollout.rollout_engine
    ucfg = _unsloth_config(trainer)
    opts = {} if shared is not None else ucfg.engine_options()
    seed = ucfg.seed if ucfg.seed is not None else getattr(trainer.config, "seed", None)
    rank = trainer.actor.data_parallel_rank
    if seed is not None and rank:
        seed = int(seed) + rank  # replicas sample independent streams (rank 0 keeps the 1-process seed)
    engine = UnslothInferenceEngine(config, trainer.actor.policy, rollout_engine=shared, seed=seed, **opts)
    engine.initialize(train_data_parallel_size=trainer.actor_alloc.parallel.dp_size)
    return engine


def validate_config(trainer) -> None:
    """Checks specific to the unsloth backend (AReaL's own _validate_cfg runs too); before any model loads.

    Accepts ``rollout.backend: "unsloth:dN"`` with ``actor.backend: "unsloth:dN"`` (or ``"fsdp:dN"``) on a
    launch of N processes; refuses model parallelism inside a replica, mismatched N, or an N that is not
    the number of processes, with ``UnsupportedParallelismError`` naming what is supported.
    """
    from .distributed import check_shapes

    if trainer.config.critic is not None:
        raise ValueError("critic: the unsloth backend trains actor-only algorithms (GRPO, DAPO, ...); "
                         "set critic to null")
    if trainer.actor_alloc.backend not in _TRAIN_BACKENDS:
        raise ValueError(f"actor.backend: use 'unsloth:dN' with rollout.backend 'unsloth:...', "
                         f"got {trainer.config.actor.backend!r}")
    check_shapes(trainer.config.rollout.backend, trainer.rollout_alloc.parallel, trainer.config.actor.backend,
                 trainer.actor_alloc.parallel)


# ============================================================================ install
def _patch_grammar() -> None:
    from areal.api import alloc_mode

    if '"unsloth"' in alloc_mode.ALLOCATION_GRAMMAR:
        return
    if _GRAMMAR_OLD not in alloc_mode.ALLOCATION_GRAMMAR:
        raise RuntimeError("install(): AReaL's allocation grammar changed (INFER_BACKEND not found); "
                           "this areal version is not supported")
    # A new Lark parser is built from this module global on every parse, so replacing it is enough.
    alloc_mode.ALLOCATION_GRAMMAR = alloc_mode.ALLOCATION_GRAMMAR.replace(_GRAMMAR_OLD, _GRAMMAR_NEW)


def _patch_launcher_allocation() -> None:
    """AReaL's SPMD launchers size the trainer job from ``allocation_mode`` via ``_AllocationMode``, whose
    training allocations are fsdp/megatron/archon only; count ``unsloth:dN`` as N trainer processes."""
    allocation_mode = compat.ALLOCATION_MODE.get()
    original = compat.TRAINING_ALLOCATIONS.get()
    if getattr(original, "_unsloth_wrapped", False):
        return

    @functools.wraps(original)
    def _get_training_allocations(self):
        return [a for a in self.allocations if a.backend in ("fsdp", "megatron", "archon", BACKEND_NAME)]

    _get_training_allocations._unsloth_wrapped = True
    setattr(allocation_mode, compat.TRAINING_ALLOCATIONS.name, _get_training_allocations)


def _wrap(name: str, make):
    """Wrap the PPOTrainer private method ``name`` (a hook listed, with its AReaL version, in compat)."""
    hook = compat.trainer_hook(name)
    original = hook.get()
    if getattr(original, "_unsloth_wrapped", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._unsloth_wrapped = True
    setattr(hook.owner(), name, wrapped)


def _patch_trainer() -> None:
    def init_scheduler(orig):
        def f(self):
            return None if uses_unsloth(self) else orig(self)
        return f

    def create_train(orig):
        def f(self, actor_config, alloc):
            return create_train_engine(self, actor_config, alloc) if uses_unsloth(self) else orig(
                self, actor_config, alloc)
        return f

    def init_rollout(orig):
        def f(self, rollout_config, is_eval=False, lora_path=None):
            if uses_unsloth(self):
                return create_rollout(self, rollout_config, is_eval=is_eval)
            return orig(self, rollout_config, is_eval=is_eval, lora_path=lora_path)
        return f

    def save_initial_lora(orig):
        def f(self):
            return None if uses_unsloth(self) else orig(self)  # nothing to preload: the engine shares the model
        return f

    def validate(orig):
        def f(self):
            orig(self)
            if uses_unsloth(self):
                validate_config(self)
        return f

    _wrap("_init_scheduler", init_scheduler)
    _wrap("_create_train_engine", create_train)
    _wrap("_init_rollout", init_rollout)
    _wrap("_save_initial_lora_weights", save_initial_lora)
    _wrap("_validate_cfg", validate)

    def ensure_proxy(orig):
        def f(self):
            if uses_unsloth(self):  # agent workflows: the engine serves them in process (agent_server)
                setattr(self, compat.TRAINER_PROXY_STARTED_ATTR, True)
                return None
            return orig(self)
        return f

    _wrap("_ensure_proxy_started", ensure_proxy)


def _patched_source() -> bool:
    """True when AReaL's files already carry patches/areal-1.0.4-unsloth-backend.patch."""
    from areal.trainer import rl_trainer

    return getattr(rl_trainer, "UNSLOTH_BACKEND_PATCHED", False)


def install() -> None:
    """Make AReaL accept ``backend: "unsloth:dN"`` and PPOTrainer build the colocated engines (idempotent)."""
    with _lock:
        _patch_grammar()
        _patch_launcher_allocation()
        patch_openai()
        if not _patched_source():
            _patch_trainer()


def is_installed() -> bool:
    from areal.api import alloc_mode

    return f'"{BACKEND_NAME}"' in alloc_mode.ALLOCATION_GRAMMAR
