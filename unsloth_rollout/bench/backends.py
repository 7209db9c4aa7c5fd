"""The generation backends the benchmark compares, all on one PolicyModel and one Workload.

Each backend turns the workload's requests into ``SampleResult``s (output ids cut at EOS, the
logprobs it returns, the time its first token appeared). The harness in ``__main__`` times
``run()``, samples memory around it and checks logprobs against a teacher-forced forward.

- ``engine``: unsloth_rollout's RolloutEngine, every request submitted at once (``engine-bitwise``: under the
  bitwise on-policy mode, with the trainer's side of it measured after the run).
- ``hf-sequential``: ``model.generate()`` one request at a time, the loop users write by hand.
- ``hf-batched``: one left-padded ``generate()`` per GRPO group (the group repeated), as TRL does.
- ``transformers-cb``: transformers' continuous batching manager (text models only).
- ``vllm`` / ``sglang``: their offline engines, when installed with a GPU (not exercised in CI).
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from ..engine.inputs import InputPreparer
from .workloads import BenchRequest, Workload, image_inputs


@dataclass
class SampleResult:
    index: int  # BenchRequest.index
    output_ids: list[int]
    logprobs: list[float] | None
    first_token_time: float | None  # perf_counter() when the first token appeared


@dataclass
class RunOutput:
    samples: list[SampleResult]
    notes: list[str] = field(default_factory=list)
    # Estimated TTFTs (seconds from the start of the run) for every request, when not all were run.
    ttft_override: list[float] | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class BenchContext:
    policy: object
    workload: Workload
    lora_rank: int
    kv_cache_bytes: int = 1 << 30
    hf_sequential_max: int = 24
    hf_batch_groups: int = 1
    cb_block_size: int = 32
    cb_max_batch_tokens: int = 4096  # the engine's default max_prefill_tokens

    @property
    def temperature(self) -> float:
        return self.workload.temperature


def cut_at_eos(ids: list[int], eos_ids: list[int], ignore_eos: bool, budget: int) -> list[int]:
    """Tokens a request really produced: up to and including the first EOS, at most ``budget``."""
    ids = ids[:budget]
    if not ignore_eos:
        for i, t in enumerate(ids):
            if t in eos_ids:
                return ids[: i + 1]
    return ids


def spread(n: int, k: int) -> list[int]:
    """``k`` indices evenly spread over ``range(n)`` (all of them when k >= n)."""
    if k >= n:
        return list(range(n))
    return sorted({round(float(x)) for x in np.linspace(0, n - 1, k)})


def warmup_request(r: BenchRequest, max_new_tokens: int = 4) -> BenchRequest:
    """A short request like ``r`` but with a different prompt (its last token dropped), so that warming
    up leaves nothing in a prefix cache that the timed run could reuse."""
    return BenchRequest(-1, -1, 0, list(r.prompt_ids[:-1]), r.image, max_new_tokens, r.seed)


class Backend:
    name = ""
    supports_lora = True
    lora_note = ""

    def unavailable(self, ctx: BenchContext) -> str | None:
        """Why this backend cannot run here, or None."""
        return None

    def setup(self, ctx: BenchContext) -> None:
        """Untimed preparation (counted in peak memory)."""

    def warmup(self, ctx: BenchContext) -> None:
        """Untimed short generation so that first-call costs are not timed."""

    def run(self, ctx: BenchContext, requests: list[BenchRequest], t0: float, progress) -> RunOutput:
        raise NotImplementedError

    def teardown(self, ctx: BenchContext) -> None:
        pass


# ============================================================================ engine
class EngineBackend(Backend):
    name = "engine"
    decode = None  # DecodeConfig fields this variant sets (None: the engine's defaults)

    def setup(self, ctx):
        from ..engine import EngineConfig, RolloutEngine
        from ..engine.config import DecodeConfig

        n = len(ctx.workload.requests)
        self.engine = RolloutEngine(ctx.policy, EngineConfig(kv_cache_memory_bytes=ctx.kv_cache_bytes,
                                                             max_num_seqs=max(256, n),
                                                             decode=DecodeConfig(**(self.decode or {}))),
                                    seed=ctx.workload.seed)

    def _request(self, ctx, r: BenchRequest, max_new_tokens: int | None = None):
        from ..engine import GenerationRequest, SamplingParams

        sp = SamplingParams(max_new_tokens=max_new_tokens or r.max_new_tokens, temperature=ctx.temperature,
                            seed=r.seed, ignore_eos=ctx.workload.ignore_eos)
        return GenerationRequest(input_ids=list(r.prompt_ids), images=[r.image] if r.image is not None else None,
                                 sampling=sp, request_id=f"bench-{r.index}")

    def warmup(self, ctx):
        # the first group, as hf-batched warms: a group's samples read their shared prompt once, in a graph the
        # compiled step compiles before the first such step
        reqs = [self._request(ctx, warmup_request(r)) for r in ctx.workload.groups()[0]]
        for i, req in enumerate(reqs):
            req.request_id = f"bench-warmup-{i}"
        self.engine.generate(reqs)

    def run(self, ctx, requests, t0, progress):
        futs = []
        for r in requests:
            f = self.engine.submit(self._request(ctx, r))
            f.add_done_callback(lambda _f: progress.update(1))
            futs.append((r, f))
        self.engine.wait_for(f for _, f in futs)  # steps on this thread, as generate() runs them
        samples = []
        for r, f in futs:
            o = f.result()[0]
            if o.error:
                raise RuntimeError(f"engine request {r.index} failed: {o.error}")
            m = o.metrics
            first = m["arrival_time"] + m["ttft_s"] if m.get("ttft_s") is not None else None
            samples.append(SampleResult(r.index, list(o.output_ids), list(o.output_logprobs), first))
        st = self.engine.stats()
        notes = [(f"prefix-cache hits {st.get('prefix_cache_hits')}, steps {st.get('steps')}, "
                  f"preemptions {st.get('num_preemptions')}; peak memory includes the preallocated "
                  f"{st['kv_cache_bytes'] / 2**30:.2f} GiB KV cache (--kv-cache-memory-bytes)")]
        if st.get("decode_backend") in ("compiled", "graph"):
            if st.get("decode_shared_prefix"):
                how = (f"steps reading a GRPO group's shared prompt once, from {st.get('decode_prefix_min_tokens')} "
                       f"shared tokens, {'run in the graph' if st.get('decode_prefix_compiled') else 'are eager'}")
            else:
                how = "every row holds its whole history"
            notes.append(f"compiled decode: warm-up {st.get('decode_warmup_s', 0.0):.1f} s at engine start (not "
                         f"timed), {st.get('decode_recompiles')} recompiles after it, "
                         f"{st.get('decode_eager_steps')} steps run eager ({how}), "
                         f"{st.get('decode_trusted_steps', 0) + st.get('decode_guarded_steps', 0)} compiled")
        elif st.get("decode_backend_fallback"):
            notes.append(f"decode backend 'auto' fell back to the eager workspace: {st['decode_backend_fallback']}")
        return RunOutput(samples, notes, extra={"engine_stats": {k: v for k, v in st.items()
                                                                 if isinstance(v, (int, float, bool))}})

    def teardown(self, ctx):
        self.engine.shutdown()
        del self.engine


class EngineCompiledBackend(EngineBackend):
    """The same engine with the compiled step forced on (``DecodeConfig(backend="compiled")``)."""

    name = "engine-compiled"
    decode = {"backend": "compiled"}


class EngineEagerBackend(EngineBackend):
    """The same engine with every decode step eager (``DecodeConfig(backend="workspace")``), beside the default
    one: what the compiled step saves on a workload."""

    name = "engine-eager"
    decode = {"backend": "workspace"}


class EngineWholeRowsBackend(EngineBackend):
    """The same engine with every decode row holding its whole history (``DecodeConfig(shared_prompt=False)``):
    what reading each GRPO group's prompt once per step saves."""

    name = "engine-whole-rows"
    decode = {"shared_prompt": False}


# ============================================================================ HF generate
class _FirstCall(LogitsProcessor):
    """Records when the first token's logits arrived (the TTFT); leaves the scores alone."""

    def __init__(self):
        self.t = None

    def __call__(self, input_ids, scores):
        if self.t is None:
            self.t = time.perf_counter()
        return scores


class _RowBudget(StoppingCriteria):
    """Per-row stop after that row's own budget: a finished row pads while the others go on,
    which is what a padded batch does when rows hit EOS at different steps."""

    def __init__(self, prompt_len: int, budgets: list[int]):
        self.prompt_len = prompt_len
        self.budgets = torch.tensor(budgets)

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.prompt_len) >= self.budgets.to(input_ids.device)


def hf_generate(ctx: BenchContext, rows: list[BenchRequest]) -> tuple[list[SampleResult], float | None]:
    """One padded ``model.generate()`` over ``rows`` (left padding, per-row budgets), as users call it."""
    policy, wl = ctx.policy, ctx.workload
    dev = policy.device
    pad = policy.tokenizer.pad_token_id
    if pad is None:
        pad = wl.eos_ids[0]
    width = max(len(r.prompt_ids) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    kwargs = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
    images = [r.image for r in rows if r.image is not None]
    if images:
        pv, grid = image_inputs(policy.processor, images)
        kwargs.update(pixel_values=pv.to(dev, policy.dtype), image_grid_thw=grid.to(dev),
                      mm_token_type_ids=(ids == wl.image_token_id).to(torch.int32).to(dev))
    first = _FirstCall()
    # The engine never samples image/video pads or vision markers (a sampled pad breaks the trainer's forward:
    # its image features no longer match the pads); suppress the same ids so both draw from one distribution.
    # output_logits stays the raw logits, so the logprobs are unaffected.
    suppress = InputPreparer(policy).vision_token_ids() if policy.is_vlm else []
    budgets = [r.max_new_tokens for r in rows]
    stop = StoppingCriteriaList([_RowBudget(width, budgets)]) if len(set(budgets)) > 1 else None
    policy.clear_rope_deltas()
    with torch.inference_mode():
        out = policy.model.generate(
            **kwargs, do_sample=True, temperature=ctx.temperature, top_k=0, top_p=1.0, min_p=None,
            repetition_penalty=1.0, max_new_tokens=max(budgets), min_new_tokens=0,
            eos_token_id=None if wl.ignore_eos else wl.eos_ids, pad_token_id=pad,
            return_dict_in_generate=True, output_logits=True,
            suppress_tokens=suppress or None, logits_processor=LogitsProcessorList([first]), stopping_criteria=stop)
    gen = out.sequences[:, width:].tolist()
    logits = torch.stack(out.logits, dim=1) if out.logits else None  # [B, T, V]
    samples = []
    for i, r in enumerate(rows):
        toks = cut_at_eos(gen[i], wl.eos_ids, wl.ignore_eos, r.max_new_tokens)
        lps = None
        if logits is not None and toks:
            lp = torch.log_softmax(logits[i, : len(toks)].float() / ctx.temperature, dim=-1)
            lps = lp.gather(1, torch.tensor(toks, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        samples.append(SampleResult(r.index, toks, lps, first.t))
    return samples, first.t


class HFSequentialBackend(Backend):
    name = "hf-sequential"

    def warmup(self, ctx):
        hf_generate(ctx, [warmup_request(ctx.workload.requests[0])])

    def run(self, ctx, requests, t0, progress):
        torch_state = torch.random.get_rng_state()
        chosen = [requests[i] for i in spread(len(requests), ctx.hf_sequential_max)]
        samples, service, first_lat = [], [], []
        for r in chosen:
            start = time.perf_counter()
            torch.manual_seed(r.seed)
            s, first = hf_generate(ctx, [r])
            samples.extend(s)
            service.append(time.perf_counter() - start)
            first_lat.append((first or start) - start)
            progress.update(1)
        torch.random.set_rng_state(torch_state)
        notes, override = [], None
        if len(chosen) < len(requests):
            notes.append(f"ran {len(chosen)} of {len(requests)} requests (evenly spaced); tokens/s from those; "
                         f"TTFT estimated as if all ran in order (i x mean request time + mean first-token time)")
            mean_s, mean_f = float(np.mean(service)), float(np.mean(first_lat))
            override = [i * mean_s + mean_f for i in range(len(requests))]
        return RunOutput(samples, notes, override)


class HFBatchedBackend(Backend):
    name = "hf-batched"

    def warmup(self, ctx):
        hf_generate(ctx, [warmup_request(r) for r in ctx.workload.groups()[0]])

    def run(self, ctx, requests, t0, progress):
        torch_state = torch.random.get_rng_state()
        groups: dict[int, list[BenchRequest]] = {}
        for r in requests:
            groups.setdefault(r.prompt_index, []).append(r)
        groups_list = list(groups.values())
        k = max(1, ctx.hf_batch_groups)
        samples = []
        for c in range(0, len(groups_list), k):
            rows = [r for g in groups_list[c:c + k] for r in g]
            torch.manual_seed(rows[0].seed)
            s, _ = hf_generate(ctx, rows)
            samples.extend(s)
            progress.update(len(rows))
        torch.random.set_rng_state(torch_state)
        note = (f"{k} group(s) of {ctx.workload.group} per generate() call, left padding; "
                "a row stops at its own budget (EOS stand-in) while the batch runs to its longest row")
        return RunOutput(samples, [note])


# ============================================================================ transformers continuous batching
class TransformersCBBackend(Backend):
    name = "transformers-cb"

    def unavailable(self, ctx):
        if ctx.policy.is_vlm:
            return ("transformers continuous batching is text-only (no pixel_values per request; "
                    "huggingface/transformers#43386)")
        if not hasattr(ctx.policy.base_model, "continuous_batching_context_manager"):
            return "this transformers version has no continuous batching API"
        return None

    def _configs(self, ctx, requests, max_new_tokens):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        wl = ctx.workload
        bs = ctx.cb_block_size
        blocks = sum(math.ceil((len(r.prompt_ids) + r.max_new_tokens + 1) / bs) for r in requests) + 64
        gen = GenerationConfig(do_sample=True, temperature=ctx.temperature, top_k=0, top_p=1.0,
                               max_new_tokens=max_new_tokens, eos_token_id=-1 if wl.ignore_eos else wl.eos_ids,
                               pad_token_id=wl.eos_ids[0] if wl.eos_ids else 0)
        # An explicit small cache: on CPU it would otherwise be sized from system RAM.
        cb = ContinuousBatchingConfig(block_size=bs, num_blocks=blocks, max_batch_tokens=ctx.cb_max_batch_tokens,
                                      max_requests_per_batch=max(1, len(requests)), return_logprobs=True,
                                      seed=wl.seed)
        return gen, cb

    def setup(self, ctx):
        # The manager (its cache and thread) is built and started here, untimed, like the engine.
        wl = ctx.workload
        gen, cb = self._configs(ctx, wl.requests, wl.max_new_tokens)
        self._cm = ctx.policy.base_model.continuous_batching_context_manager(
            generation_config=gen, continuous_batching_config=cb, block=True, timeout=60)
        self.manager = self._cm.__enter__()

    def _generate(self, ctx, requests, tag: str, progress=None):
        # No inference_mode here: the manager's thread updates tensors created at its construction.
        eos = -1 if ctx.workload.ignore_eos else ctx.workload.eos_ids
        manager, results = self.manager, {}
        for r in requests:
            manager.add_request(list(r.prompt_ids), request_id=f"{tag}{r.index}", max_new_tokens=r.max_new_tokens,
                                eos_token_id=eos, record_timestamps=True)
        while len(results) < len(requests):
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing")
                continue
            if res.is_finished():
                if res.error:
                    raise RuntimeError(f"transformers-cb request {res.request_id} failed: {res.error}")
                results[res.request_id] = res
                if progress is not None:
                    progress.update(1)
        return results

    def warmup(self, ctx):
        self._generate(ctx, [warmup_request(ctx.workload.requests[0])], "warmup")

    def teardown(self, ctx):
        self._cm.__exit__(None, None, None)
        del self.manager, self._cm

    def run(self, ctx, requests, t0, progress):
        wl = ctx.workload
        results = self._generate(ctx, requests, "r", progress)
        samples = []
        for r in requests:
            res = results[f"r{r.index}"]
            toks = cut_at_eos(list(res.generated_tokens), wl.eos_ids, wl.ignore_eos, r.max_new_tokens)
            lps = list(res.logprobs[: len(toks)]) if res.logprobs else None
            first = res.timestamps[0] if res.timestamps else None
            samples.append(SampleResult(r.index, toks, lps, first))
        note = (f"ContinuousBatchingConfig(block_size={ctx.cb_block_size}, num_blocks sized to the workload, "
                f"max_batch_tokens={ctx.cb_max_batch_tokens}); one global seed (no per-request seeds)")
        return RunOutput(samples, [note])


# ============================================================================ GPU servers (offline engines)
def _gpu_reason(pkg: str) -> str | None:
    if importlib.util.find_spec(pkg) is None:
        return f"{pkg} is not installed"
    if not torch.cuda.is_available():
        return f"{pkg} needs a CUDA GPU and none is present"
    return None


def _save_adapter(ctx) -> str | None:
    if not ctx.lora_rank:
        return None
    d = tempfile.mkdtemp(prefix="bench-lora-")
    ctx.policy.model.save_pretrained(d)
    return d


class VLLMBackend(Backend):
    """vLLM's offline ``LLM`` (not exercised in CI: needs vllm and a GPU)."""

    name = "vllm"
    lora_note = "vLLM ignores visual.* LoRA unless --enable-tower-connector-lora (Qwen-VL family)"

    def unavailable(self, ctx):
        return _gpu_reason("vllm")

    def setup(self, ctx):
        from vllm import LLM

        self.adapter = _save_adapter(ctx)
        kw = {"enable_lora": True, "max_lora_rank": max(8, ctx.lora_rank)} if self.adapter else {}
        self.llm = LLM(model=ctx.policy.name_or_path, seed=ctx.workload.seed, gpu_memory_utilization=0.5,
                       max_model_len=8192, **kw)

    def run(self, ctx, requests, t0, progress):
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        wl = ctx.workload
        prompts, params = [], []
        for r in requests:
            ids = _collapse_image_pads(r.prompt_ids, wl.image_token_id)
            p = {"prompt_token_ids": ids}
            if r.image is not None:
                p["multi_modal_data"] = {"image": r.image}
            prompts.append(p)
            params.append(SamplingParams(temperature=ctx.temperature, top_p=1.0, top_k=-1, seed=r.seed,
                                         max_tokens=r.max_new_tokens, ignore_eos=wl.ignore_eos, logprobs=0))
        lora = LoRARequest("bench", 1, self.adapter) if self.adapter else None
        outs = self.llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        samples = []
        for r, o in zip(requests, outs):
            c = o.outputs[0]
            toks = list(c.token_ids)
            lps = [d[t].logprob for d, t in zip(c.logprobs, toks)] if c.logprobs else None
            first = getattr(getattr(o, "metrics", None), "first_token_time", None)
            samples.append(SampleResult(r.index, toks, lps, first))
            progress.update(1)
        return RunOutput(samples, ["vLLM's own clock for TTFT when it reports one"])

    def teardown(self, ctx):
        del self.llm


class SGLangBackend(Backend):
    """SGLang's offline ``Engine`` (not exercised in CI: needs sglang and a GPU)."""

    name = "sglang"
    lora_note = "SGLang ignores visual.* LoRA for Qwen-VL"

    def unavailable(self, ctx):
        return _gpu_reason("sglang")

    def setup(self, ctx):
        import sglang

        self.adapter = _save_adapter(ctx)
        kw = {"lora_paths": [self.adapter], "max_lora_rank": max(8, ctx.lora_rank)} if self.adapter else {}
        self.llm = sglang.Engine(model_path=ctx.policy.name_or_path, random_seed=ctx.workload.seed,
                                 mem_fraction_static=0.5, **kw)

    def run(self, ctx, requests, t0, progress):
        wl = ctx.workload
        ids = [_collapse_image_pads(r.prompt_ids, wl.image_token_id) for r in requests]
        params = [{"temperature": ctx.temperature, "top_p": 1.0, "max_new_tokens": r.max_new_tokens,
                   "ignore_eos": wl.ignore_eos, "sampling_seed": r.seed} for r in requests]
        kw = {"image_data": [r.image for r in requests]} if any(r.image is not None for r in requests) else {}
        if self.adapter:
            kw["lora_path"] = [self.adapter] * len(requests)
        outs = self.llm.generate(input_ids=ids, sampling_params=params, return_logprob=True, **kw)
        samples = []
        for r, o in zip(requests, outs):
            meta = o.get("meta_info", {})
            toks = list(o.get("output_ids") or [t[1] for t in meta.get("output_token_logprobs", [])])
            lps = [t[0] for t in meta.get("output_token_logprobs", [])] or None
            samples.append(SampleResult(r.index, toks, lps, None))
            progress.update(1)
        return RunOutput(samples, ["no per-request TTFT from the offline engine"])

    def teardown(self, ctx):
        self.llm.shutdown()


class EngineBitwiseBackend(EngineBackend):
    """The same engine under the bitwise on-policy mode (``unsloth_rollout/bitwise.py``: batch-invariant ops, eager
    decode steps): what logprobs equal to the trainer's bit for bit cost against the default engine. Untimed, after
    the run, its row gets the trainer's side over the first 16 samples: ``bitwise_logprob_diff_max`` (the engine's
    logprobs against the trainer's recompute under the mode: 0 when the mode holds) and the seconds of one trainer
    forward + backward over them with and without the mode (``train_step_s`` / ``train_step_plain_s``)."""

    name = "engine-bitwise"
    trainer_samples = 16

    def unavailable(self, ctx):
        from .. import bitwise

        try:
            bitwise.check(ctx.policy)
        except bitwise.BitwiseModeError as e:
            return str(e)
        return None

    def setup(self, ctx):
        from .. import bitwise

        bitwise.enable(ctx.policy)
        super().setup(ctx)

    def run(self, ctx, requests, t0, progress):
        out = super().run(ctx, requests, t0, progress)
        self._trainer_side = (ctx, {r.index: r for r in requests}, out.samples[:self.trainer_samples], out.extra)
        return out

    def teardown(self, ctx):
        from .. import bitwise
        from ..testing.bitwise import train_step_seconds, trainer_logprobs

        super().teardown(ctx)
        try:
            ctx, by_index, samples, extra = self._trainer_side
            outs = [_Scored(by_index[s.index].prompt_ids, s.output_ids, s.logprobs) for s in samples]
            temps = [ctx.temperature or 1.0] * len(outs)
            vision = []
            for s in samples:
                image = by_index[s.index].image
                pv, grid = image_inputs(ctx.policy.processor, [image]) if image is not None else (None, None)
                vision.append({"pixel_values": pv, "image_grid_thw": grid} if image is not None else None)
            lps = trainer_logprobs(ctx.policy, outs, temps, vision)
            extra["bitwise_logprob_diff_max"] = max(
                (torch.tensor(o.output_logprobs, dtype=torch.float32) - lp).abs().max().item() for o, lp in
                zip(outs, lps))
            extra["train_step_s"] = train_step_seconds(ctx.policy, outs, temps, vision)
            extra["train_step_plain_s"] = train_step_seconds(ctx.policy, outs, temps, vision, on=False)
            extra["train_step_ratio"] = extra["train_step_s"] / extra["train_step_plain_s"]
        finally:
            bitwise.disable(ctx.policy)
            ctx.policy.inference()


@dataclass
class _Scored:
    """A sample as the trainer's recompute reads it."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]


def _collapse_image_pads(ids: list[int], image_token_id: int | None) -> list[int]:
    """One placeholder per image (the servers expand it with their own processor)."""
    if image_token_id is None:
        return list(ids)
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (EngineBackend, HFSequentialBackend, HFBatchedBackend, TransformersCBBackend, VLLMBackend,
                        SGLangBackend, EngineCompiledBackend, EngineEagerBackend, EngineWholeRowsBackend,
                        EngineBitwiseBackend)
}
# Old names of backends, still accepted by --backends.
ALIASES = {"engine-static": EngineCompiledBackend.name}
# What runs without --backends: every backend but the opt-in variants of the engine: the compiled step forced
# on, every step eager (the default, "auto", is compiled on CPU: benchmarks/cpu/captured.md), whole rows
# (shared prompts off, for comparison), and the bitwise on-policy mode.
DEFAULT_BACKENDS = [b for b in BACKENDS if b not in (EngineCompiledBackend.name, EngineEagerBackend.name,
                                                     EngineWholeRowsBackend.name, EngineBitwiseBackend.name)]
