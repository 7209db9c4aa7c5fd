"""ColocatedTrainEngine: AReaL's ``TrainEngine`` over the PolicyModel the rollout engine samples from.

It implements what ``PPOActor`` (and ``PPOTrainer``) call: train / eval / forward / train_batch /
eval_batch / versions / step_lr_scheduler / save / load / connect_engine / update_weights. Batches are
AReaL's padded 2-D dicts (right padding, ``multi_modal_input`` + ``mm_token_type_ids`` for VLMs); the
optimizer holds only the trainable (LoRA) parameters. There is one copy of the weights in the
process: ``update_weights`` bumps the rollout engine's version and drops its prefix cache, it moves
no bytes.

Example::

    actor = UnslothPPOActor(ppo_actor_config, policy)      # PPOActor on this engine
    actor.initialize(ft_spec=FinetuneSpec(1, 64, 8))
    actor.connect_engine(rollout, WeightUpdateMeta(type="disk"))
    batch = rollout.rollout_batch(data, workflow=wf, group_size=4)
    for traj, lp in zip(batch, actor.compute_logp(batch)):
        traj["prox_logp"] = lp
    actor.ppo_update(actor.compute_advantages(batch))
    actor.update_weights(WeightUpdateMeta(type="disk", version=1))   # version bump, no copy
    rollout.set_version(1)
"""

from __future__ import annotations

import contextlib
import math
import os
from contextlib import nullcontext
from datetime import datetime
from typing import Any, Callable

import torch
import torch.distributed as dist

from areal.api import FinetuneSpec, InferenceEngine, SaveLoadMeta, TrainEngine, WeightUpdateMeta
from areal.api.cli_args import PPOActorConfig, TrainEngineConfig
from areal.api.io_struct import DeviceRuntimeInfo
from areal.utils import name_resolve, names, stats_tracker
from areal.utils.data import concat_padded_tensors

from .. import bitwise
from ..logs import get_logger
from ..engine.inputs import mm_token_type_ids
from ..models import PolicyModel, load_model
from ..models import weights as policy_weights

logger = get_logger("unsloth_rollout.areal.train_engine")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def token_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """``log_softmax(logits / T)[label]`` (fp32, AReaL's gather_logprobs formula) and the entropy.

    The entropy is only logged (the loss detaches it), so it is computed without a graph: the fp32
    ``[tokens, vocab]`` intermediates are not kept for backward twice.
    """
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def _row_chunks(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Split a padded batch into ``n`` row chunks, in order (tensors and per-row lists of length B)."""
    bs = batch["input_ids"].shape[0]
    n = max(1, min(n, bs))
    if n == 1:
        return [batch]
    bounds = [round(i * bs / n) for i in range(n + 1)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mb = {}
        for k, v in batch.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == bs:
                mb[k] = v[lo:hi]
            elif isinstance(v, list) and len(v) == bs:
                mb[k] = v[lo:hi]
            else:
                mb[k] = v
        out.append(mb)
    return out


class ColocatedTrainEngine(TrainEngine):
    """A TrainEngine over a PolicyModel shared with an in-process UnslothInferenceEngine.

    Args:
        config: AReaL's ``TrainEngineConfig`` / ``PPOActorConfig`` (optimizer, mb_spec, temperature,
            gradient_checkpointing, and — when ``policy`` is None — path, dtype, use_lora, lora_rank,
            lora_alpha, target_modules).
        policy: the shared PolicyModel; None loads one from ``config.path`` in ``initialize()``.
        load_options: extra ``load_model`` keyword arguments (backend, load_in_4bit, lora options such
            as ``finetune_vision_layers``) used when loading.
        reference: a frozen KL reference that runs the shared model with its LoRA adapter disabled
            (the base weights: still no copy). It cannot train.
        share_with: an engine whose PolicyModel this one uses, once that one is initialized (how
            PPOTrainer's reference shares the actor's model).
    """

    def __init__(self, config: TrainEngineConfig, policy: PolicyModel | None = None, *,
                 load_options: dict | None = None, reference: bool = False,
                 share_with: "ColocatedTrainEngine | None" = None):
        self.config = config
        self.optimizer_config = getattr(config, "optimizer", None)
        self.policy: PolicyModel | None = policy
        self._load_options = dict(load_options or {})
        self.reference = reference
        self._share_with = share_with
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.rollout_engine: InferenceEngine | None = None
        self.weight_update_meta: WeightUpdateMeta | None = None
        self._colocated = False
        self._holding_generation = False
        self._version = 0
        self._initialized = False
        self._parallel_strategy = None
        self._own_process_group = False
        self._dp = None  # distributed.DataParallel with unsloth:dN, N > 1 (see use_replica)
        self.tokenizer = policy.tokenizer if policy is not None else None
        self.processor = policy.processor if policy is not None else None

    # ================================================================== setup
    def create_process_group(self, parallel_strategy=None):
        """One model per process. ``unsloth:dN`` (N > 1): join the N-rank group as one data-parallel replica
        (``distributed.DataParallel``). d1 under AReaL's SPMD launcher: a 1-process gloo group, so the
        trainer's barriers work."""
        self._parallel_strategy = parallel_strategy
        dp = getattr(parallel_strategy, "data_parallel_size", 1) if parallel_strategy is not None else 1
        from .distributed import DataParallel, check_shapes

        if parallel_strategy is not None:
            spec = getattr(self.config, "backend", None)
            spec = spec if isinstance(spec, str) and ":" in spec else f"unsloth:d{dp}"
            check_shapes(spec, parallel_strategy, spec, parallel_strategy, fields=("backend", "backend"))
        if dp != 1:
            if self._dp is None:  # backend.create_train_engine joins the group before loading the model
                self._dp = DataParallel.init(dp)
            return
        from areal.utils.environ import is_single_controller

        if not is_single_controller() and not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError("WORLD_SIZE: the unsloth backend runs a single process (WORLD_SIZE=1)")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_process_group = True

    def _lora_options(self) -> dict | None:
        cfg = self.config
        extra = self._load_options.get("lora")
        if not getattr(cfg, "use_lora", False):
            return None
        lora = dict(extra or {})
        lora.setdefault("r", int(cfg.lora_rank))
        lora.setdefault("lora_alpha", int(cfg.lora_alpha))
        targets = list(getattr(cfg, "target_modules", None) or [])
        if targets and targets != ["all-linear"]:
            lora.setdefault("target_modules", targets)
        return lora

    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, *args, **kwargs):
        """Load the policy (unless one was given) and build the optimizer over its trainable parameters."""
        if self._initialized:
            return
        if self.policy is None and self._share_with is not None:
            shared = self._share_with.policy
            if shared is None:
                raise RuntimeError("share_with: initialize the engine that owns the model first")
            # A reference shares the model only through its LoRA switch; a full fine-tune needs its own copy.
            if not self.reference or hasattr(shared.model, "disable_adapter"):
                self.policy = shared
        if self.policy is None:
            if not self.config.path:
                raise ValueError("path: give config.path (a model folder) or pass policy= to the engine")
            opts = dict(self._load_options)
            opts.pop("lora", None)
            opts.setdefault("dtype", _DTYPES.get(str(self.config.dtype), None))
            opts.setdefault("gradient_checkpointing", bool(self.config.gradient_checkpointing))
            opts.setdefault("backend", "auto")
            self.policy = load_model(self.config.path, lora=self._lora_options(), **opts)
        self.tokenizer = self.policy.tokenizer
        self.processor = self.policy.processor
        if not self.reference:
            self._create_optimizer(ft_spec)
            if self._dp is not None:  # replicas start from rank 0's trainable weights, as DDP does
                self._dp.broadcast_params(self._trainable())
        self._initialized = True

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def _create_optimizer(self, ft_spec: FinetuneSpec | None) -> None:
        oc = self.optimizer_config
        if oc is None:
            return
        params = self._trainable()
        if not params:
            raise ValueError("the policy has no trainable parameters (enable LoRA: actor.use_lora=true)")
        if oc.type in ("adam", "adam_bf16"):
            self.optimizer = torch.optim.AdamW(params, lr=oc.lr, weight_decay=oc.weight_decay,
                                               betas=(oc.beta1, oc.beta2), eps=oc.eps)
        elif oc.type == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=oc.lr, weight_decay=oc.weight_decay)
        else:
            raise ValueError(f"optimizer.type must be 'adam', 'adam_bf16' or 'sgd', got {oc.type!r}")
        from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                                  get_linear_schedule_with_warmup)

        total = ft_spec.total_train_steps if ft_spec is not None else 0
        warmup = int(oc.warmup_steps_proportion * total)
        if oc.lr_scheduler_type == "cosine" and total:
            self.lr_scheduler = get_cosine_schedule_with_warmup(self.optimizer, warmup, total)
        elif oc.lr_scheduler_type == "linear" and total:
            self.lr_scheduler = get_linear_schedule_with_warmup(self.optimizer, warmup, total)
        elif oc.lr_scheduler_type in ("constant", "cosine", "linear"):
            self.lr_scheduler = get_constant_schedule_with_warmup(self.optimizer, warmup)
        else:
            raise ValueError(f"optimizer.lr_scheduler_type must be linear, cosine or constant, "
                             f"got {oc.lr_scheduler_type!r}")

    def destroy(self):
        self._release_generation()
        self._initialized = False
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_process_group = False
        if self._dp is not None and not self.reference:
            self._dp.destroy()

    @property
    def initialized(self) -> bool:
        return self._initialized

    # d1: the data-parallel world is this process. dN: every replica is its own data-parallel head
    # (it runs its own rollouts on its own shard), and the world group is the data-parallel group.
    @property
    def data_parallel_group(self):
        return self._dp.group if self._dp is not None else None

    @property
    def data_parallel_rank(self) -> int:
        return self._dp.rank if self._dp is not None else 0

    @property
    def data_parallel_world_size(self) -> int:
        return self._dp.world_size if self._dp is not None else 1

    def current_data_parallel_head(self) -> int:
        return self._dp.rank if self._dp is not None else 0

    def is_data_parallel_head(self) -> bool:
        return True

    @property
    def context_and_model_parallel_group(self):
        return None

    @property
    def cpu_group(self):
        return self._dp.cpu_group if self._dp is not None else None

    # ================================================================== modes
    def train(self, mode: bool = True):
        """Training mode (gradient checkpointing per config) or, with mode=False, inference mode."""
        if mode and not self.reference:
            self.policy.training(gradient_checkpointing=bool(getattr(self.config, "gradient_checkpointing", False)))
        else:
            self.policy.inference()
        return self

    # ================================================================== inputs and forward
    @property
    def temperature(self) -> float:
        return float(getattr(self.config, "temperature", 1.0) or 1.0)

    def _as_batch(self, input_) -> dict[str, Any]:
        if isinstance(input_, list):
            return concat_padded_tensors(input_)
        return input_

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        dev = self.policy.device
        return {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def _model_inputs(self, mb: dict[str, Any]) -> dict[str, Any]:
        policy = self.policy
        dev = policy.device
        ids = mb["input_ids"].to(dev, torch.long)  # Qwen-VL rope indexing needs int64
        attn = mb["attention_mask"].to(dev)
        kw: dict[str, Any] = {"input_ids": ids, "attention_mask": attn.long(), "use_cache": False}
        if not policy.is_vlm:
            return kw
        cfg = policy.config
        mm = mb.get("multi_modal_input") or []
        pixels = [m["pixel_values"] for m in mm if isinstance(m, dict) and m.get("pixel_values") is not None]
        grids = [m["image_grid_thw"] for m in mm if isinstance(m, dict) and m.get("image_grid_thw") is not None]
        if pixels:
            kw["pixel_values"] = torch.cat(pixels, 0).to(dev, policy.dtype)
            kw["image_grid_thw"] = torch.cat([g.view(-1, 3) for g in grids], 0).to(dev)
        types = mb.get("mm_token_type_ids")
        if types is None:  # e.g. ArealOpenAI trajectories: derive from the placeholder tokens
            types = mm_token_type_ids(ids, cfg)
        kw["mm_token_type_ids"] = types.to(dev, torch.long)
        return kw

    def _logits(self, mb: dict[str, Any]) -> torch.Tensor:
        self.policy.clear_rope_deltas()  # a stale M-RoPE delta from generation would shift positions
        ctx = self.policy.model.disable_adapter() if self.reference and hasattr(
            self.policy.model, "disable_adapter") else nullcontext()
        with ctx:
            return self.policy.model(**self._model_inputs(mb)).logits

    def _logprobs(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Shifted: out[b, t] = log p(input_ids[b, t+1] | ...), 0 where t+1 is padding or past the end.

        AReaL does not trim minibatches to their longest row; the forward runs on the trimmed columns
        and the result is padded back to the batch width.
        """
        attn = mb["attention_mask"]
        width = attn.shape[1]
        used = max(1, int(attn.sum(-1).max()))
        view = dict(mb)
        for k in ("input_ids", "attention_mask", "mm_token_type_ids"):
            if torch.is_tensor(mb.get(k)) and mb[k].dim() == 2:
                view[k] = mb[k][:, :used]
        # the bitwise on-policy mode (unsloth_rollout/bitwise.py): the forward and the log-softmax the engine ran
        with bitwise.mode(self.policy) if bitwise.enabled(self.policy) else nullcontext():
            logits = self._logits(view)
            ids = view["input_ids"].to(logits.device, torch.long)
            logp, entropy = token_logprobs_entropy(logits, torch.roll(ids, shifts=-1, dims=-1), self.temperature)
        del logits
        valid = torch.roll(view["attention_mask"].to(logp.device).bool(), shifts=-1, dims=-1)
        valid[:, -1] = False
        logp, entropy = logp * valid, entropy * valid
        if used < width:
            logp = torch.nn.functional.pad(logp, (0, width - used))
            entropy = torch.nn.functional.pad(entropy, (0, width - used))
        return logp, entropy

    def _num_chunks(self, batch: dict[str, Any]) -> int:
        spec = getattr(self.config, "mb_spec", None)
        n = (getattr(spec, "n_mbs", None) or 1) if spec is not None else 1
        max_tokens = getattr(spec, "max_tokens_per_mb", None) if spec is not None else None
        if max_tokens:
            tokens = int(batch["attention_mask"].sum())
            n = max(n, math.ceil(tokens / max_tokens))
        return n

    @torch.no_grad()
    def forward_batch(self, input_, output_seqlens: list[int] | None = None,
                      aggregate_fn: Callable[[list[torch.Tensor]], torch.Tensor] = torch.cat):
        """Shifted token logprobs ``[B, T]`` of a padded batch (no grad); a list in, a list out.

        ``aggregate_fn`` targets packed 1-D outputs and is not used: padded row chunks are joined on dim 0.
        """
        trajs = input_ if isinstance(input_, list) else None
        batch = self._as_batch(input_)
        outs = []
        with self.policy.lock, self._scoring_mode():
            for mb in _row_chunks(batch, self._num_chunks(batch)):
                outs.append(self._logprobs(mb)[0])
        out = torch.cat(outs, 0)
        if trajs is None:
            return out
        sizes = [t["input_ids"].shape[0] for t in trajs]
        lens = [t["input_ids"].shape[1] for t in trajs]
        return [o[:, :n] for o, n in zip(torch.split(out, sizes, 0), lens)]

    # ================================================================== training
    def _hold_generation(self) -> None:
        """Keep the colocated engine from sampling between the first optimizer step and update_weights(),
        so every token is stamped with the version of the weights that produced it."""
        eng = self._colocated_rollout()
        if eng is not None and not self._holding_generation:
            # A pause of its own ("trainer"): update_weights() releases this one and no one else's.
            eng.pause("keep", holder="trainer")  # before policy.lock: the engine takes its step lock, then it
            self._holding_generation = True

    def _release_generation(self) -> None:
        eng = self._colocated_rollout()
        if eng is not None and self._holding_generation:
            self._holding_generation = False
            eng.resume(holder="trainer")

    def _colocated_rollout(self):
        if not self._colocated or self.rollout_engine is None:
            return None
        return getattr(self.rollout_engine, "rollout_engine", None)

    def _run_loss(self, batch, loss_fn, loss_weight_fn, backward: bool) -> torch.Tensor:
        batch = self._to_device(batch)
        chunks = _row_chunks(batch, self._num_chunks(batch))
        weights = [float(loss_weight_fn(mb)) for mb in chunks]
        total = sum(weights)
        if self._dp is not None:  # normalise by the tokens of the whole (global) batch, as FSDPEngine does
            total = self._dp.all_reduce_sum(total)
        total = total or 1.0
        loss_sum = torch.zeros((), device=self.policy.device)
        for mb, w in zip(chunks, weights):
            if w == 0:
                continue
            logp, entropy = self._logprobs(mb)
            loss = loss_fn(logp, entropy, mb) * (w / total)
            if backward:
                loss.backward()
            loss_sum = loss_sum + loss.detach()
        return loss_sum

    def train_batch(self, input_, loss_fn, loss_weight_fn) -> dict[str, float]:
        """One optimizer step on a padded mini-batch: zero grads, forward, ``loss_fn``, backward, clip, step."""
        if self.reference or self.optimizer is None:
            raise RuntimeError("train_batch: this engine has no optimizer (reference engine or config.optimizer=None)")
        batch = self._as_batch(input_)
        self._hold_generation()
        with self.policy.lock:
            if not self.policy.is_training:
                self.train(True)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._run_loss(batch, loss_fn, loss_weight_fn, backward=True)
            if self._dp is not None:  # sum the LoRA gradients of the replicas: one global step everywhere
                self._dp.all_reduce_grads(self._trainable())
                loss = torch.tensor(self._dp.all_reduce_sum(float(loss), "loss all-reduce"))
            stats = self.optimizer_step()
        stats["loss"] = float(loss)
        return stats

    def _scoring_mode(self):
        """Inference mode for a no-grad forward, restoring the trainer's mode afterwards (a no-op when the policy
        is already in inference mode)."""
        return self.policy.inference() if self.policy.is_training else contextlib.nullcontext()

    @torch.no_grad()
    def eval_batch(self, input_, loss_fn, loss_weight_fn) -> torch.Tensor | None:
        batch = self._as_batch(input_)
        with self.policy.lock, self._scoring_mode():
            return self._run_loss(batch, loss_fn, loss_weight_fn, backward=False)

    def forward_backward_batch(self, mb_list, process_output_fn, forward_only: bool = False) -> None:
        for item in mb_list:
            mb = getattr(item, "orig_mb", item)
            logits = self._logits(self._to_device(mb))
            loss = process_output_fn(logits, mb)
            if loss is not None and not forward_only:
                loss.backward()

    def optimizer_zero_grad(self):
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict[str, float]:
        params = self._trainable()
        clip = getattr(self.optimizer_config, "gradient_clipping", None) or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        ok = math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
        else:
            logger.warning(f"non-finite grad norm {grad_norm}; optimizer step skipped")
            self.optimizer.zero_grad(set_to_none=True)
        return {"update_successful": float(ok), "grad_norm": grad_norm if ok else 0.0,
                "lr": float(self.optimizer.param_groups[0]["lr"])}

    def lr_scheduler_step(self):
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    # ================================================================== rollout connection and weights
    def use_replica(self, replica) -> None:
        """Train as one of N data-parallel replicas (``distributed.DataParallel``; ``unsloth:dN``, N > 1): the
        backend joins the process group before the model loads and hands it over here."""
        self._dp = replica

    def connect_engine(self, engine: InferenceEngine, meta: WeightUpdateMeta):
        """Remember the rollout engine. If it samples from this very PolicyModel, weight updates become
        version bumps; otherwise ``update_weights`` uses AReaL's disk protocol (adapter files)."""
        self.rollout_engine = engine
        self.weight_update_meta = meta
        self._colocated = getattr(engine, "policy", None) is self.policy if self.policy is not None else False
        if self._colocated:
            engine.attach_trainer(self)

    def update_weights(self, meta: WeightUpdateMeta):
        """Colocated: stamp the new version on the engine and drop KV computed by the old weights (the
        prefix cache, and the cache of sequences in flight: they are recomputed with the new weights before
        their next token, so tokens stamped with the new version come from it).

        No parameter is copied or reloaded: the engine already holds these tensors.
        """
        if self.rollout_engine is None:
            raise RuntimeError("update_weights: call connect_engine(rollout, meta) first")
        version = meta.version if meta.version is not None else self.get_version()
        if self._dp is not None:
            self._dp.check_lockstep(version)
        if self._colocated:
            eng = self.rollout_engine.rollout_engine
            eng.weights_changed(version)  # also when the version is unchanged: the weights did change
            self.policy.inference()
            self._release_generation()
            return
        if meta.type != "disk":
            raise NotImplementedError(f"meta.type: a non-colocated rollout engine needs weight_update_mode='disk', "
                                      f"got {meta.type!r}")
        self._update_weights_from_disk(meta)

    def _update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        # AReaL's handshake (FSDPEngine._update_weights_from_disk), for a rollout engine elsewhere.
        rollout = self.rollout_engine
        rollout.pause_generation()
        fut = rollout.update_weights_from_disk(meta)
        with self.policy.lock:
            self.policy.model.save_pretrained(meta.path)
        exp, trial = getattr(self.config, "experiment_name", None), getattr(self.config, "trial_name", None)
        if isinstance(exp, str) and isinstance(trial, str):
            name_resolve.add(names.update_weights_from_disk(exp, trial, self.get_version()),
                             str(datetime.now().timestamp()), keepalive_ttl=120)
        fut.result()
        rollout.continue_generation()

    def set_version(self, version: int):
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def rollout_batch(self, data, workflow, workflow_kwargs=None, group_size: int = 1, **kwargs):
        return self._connected().rollout_batch(data, workflow, workflow_kwargs, group_size=group_size, **kwargs)

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, should_accept_fn=None, group_size: int = 1,
                      dynamic_bs: bool = False, **kwargs):
        return self._connected().prepare_batch(dataloader, workflow, workflow_kwargs,
                                               should_accept_fn=should_accept_fn, group_size=group_size,
                                               dynamic_bs=dynamic_bs, **kwargs)

    def _connected(self) -> InferenceEngine:
        if self.rollout_engine is None:
            raise RuntimeError("call connect_engine(rollout, meta) before rollout_batch / prepare_batch")
        return self.rollout_engine

    # ================================================================== checkpoints
    def save(self, meta: SaveLoadMeta):
        """``weight_format="hf"``: the PEFT adapter (LoRA, vision LoRA included) or the full model, plus the
        optimizer state when ``with_optim``."""
        if meta.weight_format not in ("hf", "dcp"):
            raise ValueError(f"weight_format must be 'hf' or 'dcp', got {meta.weight_format!r}")
        if self._dp is not None and self._dp.rank != 0:
            return  # the replicas hold identical weights and optimizer states: rank 0 writes them
        os.makedirs(meta.path, exist_ok=True)
        model = self.policy.model
        with self.policy.lock:
            model.save_pretrained(meta.path)
        is_peft = hasattr(model, "peft_config")
        if not is_peft:
            for obj in (meta.tokenizer, meta.processor):
                if obj is not None:
                    obj.save_pretrained(meta.path)
        if meta.with_optim and self.optimizer is not None:
            state = {"optimizer": self.optimizer.state_dict(), "version": self._version,
                     "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
            torch.save(state, os.path.join(meta.path, "optimizer_state.pt"))

    def load(self, meta: SaveLoadMeta):
        """Copy saved weights into the live parameters (in place: the engine keeps its tensors)."""
        policy_weights.load_checkpoint(self.policy, meta.path)
        opt_file = os.path.join(meta.path, "optimizer_state.pt")
        if meta.with_optim and self.optimizer is not None and os.path.isfile(opt_file):
            state = torch.load(opt_file, map_location=self.policy.device, weights_only=False)
            self.optimizer.load_state_dict(state["optimizer"])
            if self.lr_scheduler is not None and state.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self._colocated:
            self.rollout_engine.rollout_engine.weights_changed()

    # ================================================================== misc
    def export_stats(self) -> dict[str, float]:
        """This process's statistics; with dN averaged over the replicas (as FSDPEngine does)."""
        return stats_tracker.export_all(reduce_group=self.data_parallel_group)

    def onload(self) -> None:
        """Nothing to do: the weights are shared with the rollout engine and stay where they are."""

    def offload(self) -> None:
        """Nothing to do (see onload)."""

    def get_device_stats(self) -> DeviceRuntimeInfo:
        try:
            return DeviceRuntimeInfo.get_current()
        except Exception:  # noqa: BLE001 - no accelerator platform
            return DeviceRuntimeInfo(0.0, 0.0, 0.0, 0.0, "GB")

    def clear_batches(self, *args, **kwargs) -> None:
        """PPOTrainer (single-controller) frees RPC batch buffers here; in-process there are none."""

    def config_perf_tracer(self, config, rank: int = 0, role: str = "actor") -> None:
        from areal.utils import perf_tracer

        perf_tracer.configure(config, rank=rank, role=role)


class UnslothPPOActor(ColocatedTrainEngine):
    """``PPOActor`` on a ColocatedTrainEngine (the FSDPPPOActor pattern): compute_logp /
    compute_advantages / ppo_update.

    Example::

        actor = UnslothPPOActor(PPOActorConfig(...), policy)
        actor.initialize(ft_spec=ft_spec)
    """

    def __init__(self, config: PPOActorConfig, policy: PolicyModel | None = None, **kwargs):
        from areal.trainer.ppo.actor import PPOActor

        super().__init__(config, policy, **kwargs)
        self.actor = PPOActor(config, self)

    @torch.no_grad()
    def compute_logp(self, *args, **kwargs) -> list[torch.Tensor] | None:
        return self.actor.compute_logp(*args, **kwargs)

    @torch.no_grad()
    def compute_advantages(self, *args, **kwargs) -> list[dict[str, Any]]:
        return self.actor.compute_advantages(*args, **kwargs)

    def ppo_update(self, *args, **kwargs) -> None:
        self.actor.ppo_update(*args, **kwargs)
