"""A randomized differential test of the engine: draw a mix of features, run it, hold every output to oracles.

Each feature has its own tests on configurations those tests build; defects live in the combinations (vision
LoRA x named adapter x packed prefill, chunking x packing, a top_p row beside a seeded row). ``draw_mix(seed)``
draws one combination: a family (text or VLM), the policy's LoRA or none, rows with named adapters (``a1``: LoRA
on the vision tower too; ``a2``: language layers only), 0-2 images of varied sizes, prompt lengths around
``prefill_chunk_tokens`` and the sliding windows, n > 1, per-row sampling parameters, two arrival waves, and events
between the waves (weight change, adapter unload + reload, preemption of everything, abort, pause, an injected
forward failure, a trainer's reference forward under ``disable_adapter()``), a KV budget small enough to preempt,
and the decode backend (the eager workspace, the gather path, or the default "auto": the compiled step on CPU).
``run_mix(mix)`` returns what failed:

- greedy rows equal HF ``generate()`` on the reference model, one prompt at a time, with the row's adapter (and
  the engine's suppressed vision tokens as ``suppress_tokens``);
- every token's logprob within 1e-5 of a teacher-forced forward of the exact weights (version) and adapter;
- seeded rows draw the same tokens as the same request run alone;
- no prefill forward is longer than ``prefill_chunk_tokens`` (or the first chunk's image reach);
- errors only where the mix asked for one (injected failure, unloaded adapter);
- afterwards the policy equals a fresh model (``FamilyModels.state_errors``).

``shrink(mix)`` drops events, rows, images and adapters one at a time while the mix still fails. ``KNOWN`` names
defects already filed; ``known_defects(mix)`` says which a mix would hit, so CI can skip those draws by name.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field

import torch

from .differential_models import NAMED, TEXT_FAMILIES, VISION_FAMILIES, family_models
from .differential_checks import TOL, check_rows, make_images, processor_inputs  # noqa: F401

# Defects filed and being fixed; the lead deletes an entry once its fix is merged (draws then run again).
KNOWN = {
}
EVENTS = ("weight_change", "unload_reload", "offload", "abort", "pause", "fail", "reference_forward")
WORDS = ("the quick brown fox jumps over a lazy dog while Alice and Bob count 12 + 7 = 19 apples in Paris "
         "and Tokyo before the rain starts").split()
IMAGE_SIZES = [(28, 28), (32, 48), (64, 40), (56, 56), (90, 40), (30, 70), (48, 96)]


class InjectedFailure(RuntimeError):
    """Raised inside a decoder layer by the ``fail`` event."""


@dataclass
class Row:
    kind: str  # "greedy" (HF generate oracle), "seeded" (alone oracle) or "sampled"
    length: int  # prompt text length in tokens (text) or words (VLM)
    images: list = field(default_factory=list)  # (width, height) of each image
    adapter: str | None = None  # lora_name: None (the policy's own), "a1" or "a2"
    n: int = 1
    sampling: dict = field(default_factory=dict)  # SamplingParams fields
    wave: int = 0  # 0: submitted first; 1: after the events
    seed: int = 0  # prompt text and pixels
    follows: int | None = None  # a next turn: this row's prompt starts with row ``follows``'s prompt (prefix reuse)


@dataclass
class Mix:
    seed: int
    family: str
    policy_lora: bool
    chunk: int
    block_size: int
    small_kv: bool
    rows: list
    events: list
    early: bool = False  # fire the events right after the first wave is submitted (still queued), not mid-decode
    backend: str = "workspace"  # DecodeConfig.backend ("auto", the default: the compiled step on CPU)
    max_num_seqs: int = 256


# ====================================================================== drawing
def draw_mix(seed: int, families=None) -> Mix:
    """One random mix (deterministic in ``seed``)."""
    rng = random.Random(seed)
    family = rng.choice(list(families or TEXT_FAMILIES + VISION_FAMILIES))
    vlm = family in VISION_FAMILIES
    policy_lora = rng.random() < 0.85
    chunk = rng.choice([7, 16, 8192])
    marks = sorted({3, 7, 8, 9, 15, 16, 17, 25} | ({chunk - 1, chunk, chunk + 1, 2 * chunk + 1} if chunk < 100 else set()))
    rows = []
    for i in range(rng.randint(1, 5)):
        kind = rng.choice(["greedy", "greedy", "seeded", "sampled"])
        sp = {"max_new_tokens": rng.randint(2, 7)}
        if kind == "greedy":
            sp["temperature"] = 0.0
        else:
            sp["temperature"] = rng.choice([0.7, 1.0, 1.3])
            if kind == "seeded":
                sp["seed"] = rng.randint(0, 10**6)
            for k, choices in (("top_k", [5, 20]), ("top_p", [0.8, 0.95]), ("min_p", [0.05]),
                               ("repetition_penalty", [1.3]), ("frequency_penalty", [0.5]),
                               ("presence_penalty", [-0.5, 0.5]), ("stop", [["e"], ["the"]]), ("logprobs", [2])):
                if rng.random() < 0.25:
                    sp[k] = rng.choice(choices)
            if rng.random() < 0.25:
                sp["min_new_tokens"] = min(2, sp["max_new_tokens"])
        n_img = rng.choice([0, 1, 1, 2]) if vlm else 0
        adapters = [None, None] + (list(NAMED) if policy_lora else list(NAMED) * 2)
        rows.append(Row(kind=kind, length=rng.choice(marks) if rng.random() < 0.7 else rng.randint(2, 40),
                        images=[rng.choice(IMAGE_SIZES) for _ in range(n_img)], adapter=rng.choice(adapters),
                        n=rng.choice([1, 1, 2, 3]), sampling=sp, wave=int(rng.random() < 0.4), seed=rng.randint(0, 10**6),
                        follows=rng.randrange(i) if i and rng.random() < 0.25 else None))
    if not policy_lora and all(r.adapter is None for r in rows):
        rows[0].adapter = "a1"  # a policy without LoRA serves only by name here
    events = [e for e in EVENTS if rng.random() < 0.2]
    if not policy_lora and "weight_change" in events:
        events.remove("weight_change")
    if "unload_reload" in events and all(r.adapter is None for r in rows):
        events.remove("unload_reload")
    return Mix(seed, family, policy_lora, chunk, rng.choice([4, 8, 16]), rng.random() < 0.3, rows, events,
               early=rng.random() < 0.3, backend=rng.choice(["workspace", "gather", "auto"]),
               max_num_seqs=rng.choice([256, 256, 2]))


def known_defects(mix: Mix) -> list[str]:
    """Names in ``KNOWN`` whose trigger this mix holds."""
    out = []
    named = [r for r in mix.rows if r.adapter is not None]
    # PEFT's adapter_names reach the vision tower whenever any row of the engine is named (the policy's own
    # LoRA is on the vision tower too), so every image prompt is exposed, named or not.
    if mix.family in VISION_FAMILIES and named and any(_has_images(mix, i) for i in range(len(mix.rows))):
        out.append("vision_lora_named")
    if "fail" in mix.events and named:
        out.append("peft_state_after_failure")
    if not mix.policy_lora and named:
        out.append("unload_last_adapter")
    if mix.early and "unload_reload" in mix.events and any(r.adapter and r.wave == 0 for r in mix.rows):
        out.append("unload_queued_request")
    return [k for k in out if k in KNOWN]


def _requests(fm, rows) -> list:
    from .. import GenerationRequest, SamplingParams

    reqs = []
    for i, row in enumerate(rows):
        rng = random.Random(row.seed)
        words = [rng.choice(WORDS) for _ in range(max(row.length, 1) + 4)]
        sp = SamplingParams(**row.sampling, n=row.n)
        first = reqs[row.follows] if row.follows is not None and row.follows < i else None
        if not fm.is_vlm:
            ids = fm.policy.tokenizer.encode(" ".join(words * 2))[: max(row.length, 1)]
            ids = (first.input_ids if first else []) + ids
            reqs.append(GenerationRequest(input_ids=ids, sampling=sp, lora_name=row.adapter, request_id=f"r{i}"))
            continue
        parts = [{"type": "image"} for _ in row.images]
        parts = ([{"type": "text", "text": "look:"}] if row.seed % 2 else []) + parts
        parts.append({"type": "text", "text": " ".join(words[: row.length])})
        msgs = [{"role": "user", "content": parts}]
        images = make_images(row.images, row.seed)
        if first:  # the earlier conversation, an assistant answer, then this turn
            msgs = first.messages + [{"role": "assistant", "content": "ok"}] + msgs
            images = list(first.images or []) + images
        reqs.append(GenerationRequest(messages=msgs, images=images or None, sampling=sp, lora_name=row.adapter,
                                      request_id=f"r{i}"))
    return reqs


# ====================================================================== running
class _Probe:
    """Hooks on the policy for one mix: the longest embedding forward, and the injected failure."""

    def __init__(self, policy):
        self.longest, self.fail_next, self.failed = 0, False, 0
        base = policy.base_model
        layers = [m for m in base.modules() if type(m).__name__.endswith("DecoderLayer")]
        self.handles = [base.get_input_embeddings().register_forward_pre_hook(self._embed),
                        layers[len(layers) // 2].register_forward_pre_hook(self._layer)]

    def _embed(self, module, args):
        self.longest = max(self.longest, args[0].shape[-1])

    def _layer(self, module, args):
        if self.fail_next:
            self.fail_next = False
            self.failed += 1
            raise InjectedFailure("InjectedFailure: the differential test's fail event")

    def remove(self):
        for h in self.handles:
            h.remove()


def _engine(fm, mix: Mix, reqs, small: bool):
    from .. import EngineConfig, RolloutEngine
    from ..engine.config import DecodeConfig, PrefillConfig
    from ..engine.kv_cache import KVCache
    from ..models.families import text_dims

    per_token = KVCache.bytes_per_token(*text_dims(fm.policy.text_config), torch.float32)
    bs = mix.block_size
    budget = 1 << 24
    if small:  # room for the longest alone (and a spare block), far from all of them together
        need = [-(-(len(_prepare(fm, r)) + r.sampling.max_new_tokens) // bs) * r.sampling.n for r in reqs]
        budget = per_token * bs * max(max(need) + 2, sum(need) // 3)
    cfg = EngineConfig(kv_cache_memory_bytes=budget, block_size=bs, prefill=PrefillConfig(chunk_tokens=mix.chunk),
                       decode=DecodeConfig(backend=mix.backend), max_num_seqs=mix.max_num_seqs)
    return RolloutEngine(fm.policy, cfg, seed=0)


def _wait(engine, cond, timeout=60.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.002)


def run_mix(mix: Mix, timeout: float = 120.0) -> list[tuple[str, str]]:
    """Run ``mix``; returns [(check, message)] of what failed (empty: every oracle held)."""
    fm = family_models(mix.family, mix.policy_lora)
    reqs = _requests(fm, mix.rows)
    failures, engine, probe = [], None, None
    version = 0
    try:
        alone = {}
        seeded = [i for i, r in enumerate(mix.rows) if r.kind == "seeded"]
        engine = _engine(fm, mix, reqs, mix.small_kv)
        for name in sorted({r.adapter for r in mix.rows if r.adapter}):
            engine.load_lora_adapter(name, fm.adapter_dirs[name])
        for i in seeded:  # the same request alone, before anything else runs
            alone[i] = [o.output_ids for o in engine.generate([dataclasses.replace(reqs[i], request_id=f"alone{i}")],
                                                              timeout=timeout)]
        probe = _Probe(fm.policy)
        decoded = engine.stats()["decode_tokens"]  # the alone runs decoded too
        futs = {i: engine.submit(reqs[i]) for i, r in enumerate(mix.rows) if r.wave == 0}
        if not mix.early:
            _wait(engine, lambda: engine.stats()["decode_tokens"] > decoded or all(f.done() for f in futs.values()))
        unloaded = None
        for ev in mix.events:
            if ev == "weight_change":
                engine.pause(holder="difftest")
                version += 1
                fm.shift_policy(mix.seed * 31 + version, version)
                engine.weights_changed(version)
                engine.resume(holder="difftest")
            elif ev == "unload_reload":
                unloaded = next(r.adapter for r in mix.rows if r.adapter)
                engine.unload_lora_adapter(unloaded)
                engine.load_lora_adapter(unloaded, fm.adapter_dirs[unloaded])
            elif ev == "offload":
                engine.offload()
                engine.onload()
            elif ev == "abort" and futs:
                engine.abort(reqs[min(futs)].request_id)
            elif ev == "pause":
                engine.pause(holder="difftest")
                time.sleep(0.01)
                engine.resume(holder="difftest")
            elif ev == "fail":
                probe.fail_next = True
            elif ev == "reference_forward" and hasattr(fm.policy.model, "disable_adapter"):
                # a trainer's reference pass (AReaL's reference engine, TRL's beta > 0): the adapter off for one
                # forward under the policy's lock, then back; the engine must see nothing of it
                engine.pause(holder="difftest")
                seen, probe.fail_next = (probe.longest, probe.fail_next), False  # not an engine forward
                with fm.policy.lock, fm.policy.model.disable_adapter(), torch.no_grad():
                    fm.policy.model(**fm.probe_inputs())
                probe.longest, probe.fail_next = seen
                engine.resume(holder="difftest")
        futs.update({i: engine.submit(reqs[i]) for i, r in enumerate(mix.rows) if r.wave == 1})
        outs = {i: f.result(timeout=timeout) for i, f in futs.items()}
        probe.remove()
        longest, probe = probe.longest, None
        suppress = engine.core.sampler.suppress_ids
        for name in sorted(engine.lora_adapters):
            engine.unload_lora_adapter(name)
        engine.invalidate_prefix_cache()  # every request finished: every block must be free again
        st = engine.stats()
        if st["kv_blocks_free"] != st["kv_blocks_total"] or st["num_running"] or st["num_waiting"]:
            failures.append(("kv_leak", f"after every request finished: {st['kv_blocks_total'] - st['kv_blocks_free']}"
                             f" KV block(s) held, {st['num_running']} running, {st['num_waiting']} waiting"))
        engine.shutdown()
        engine = None
        failures += check_rows(fm, mix, reqs, outs, alone, suppress, unloaded)
        reach = max((_vision_reach(fm, r) for r in reqs), default=0)
        if longest > max(mix.chunk, reach):
            failures.append(("prefill_chunk_bound", f"a forward ran {longest} tokens; prefill_chunk_tokens="
                             f"{mix.chunk} (first chunk's image reach {reach})"))
    except Exception as e:  # noqa: BLE001 - anything the engine raises is a finding
        failures.append(("raised", f"{type(e).__name__}: {e}"))
    finally:
        if probe is not None:
            probe.remove()
        if engine is not None:
            engine.shutdown()
            for name in list(engine.lora_adapters):
                try:
                    engine.unload_lora_adapter(name)
                except Exception as e:  # noqa: BLE001
                    failures.append(("raised", f"unload {name}: {type(e).__name__}: {e}"))
    fm.set_reference_version(version)  # the policy holds the latest weights, whatever the rows saw
    state = fm.state_errors()
    failures += [("state", s) for s in state]
    if state or any(c == "raised" for c, _ in failures):
        fm.broken = True  # the next mix gets fresh models
    else:
        fm.rebase_versions(version)
    return failures


def _prepare(fm, req):
    from ..engine.inputs import InputPreparer

    return InputPreparer(fm.policy).prepare(req).prompt_ids


def _vision_reach(fm, req) -> int:
    if not fm.is_vlm or not req.images:
        return 0
    from ..engine.inputs import InputPreparer

    prep = InputPreparer(fm.policy)
    vis = set(prep.vision_token_ids())
    ids = prep.prepare(req).prompt_ids
    return max((i + 1 for i, t in enumerate(ids) if t in vis), default=0)


# ====================================================================== oracles
# ====================================================================== shrinking and reporting
def _smaller(mix: Mix):
    """Mixes one step simpler than ``mix``."""
    for i in range(len(mix.events)):
        yield dataclasses.replace(mix, events=mix.events[:i] + mix.events[i + 1:])
    if mix.small_kv:
        yield dataclasses.replace(mix, small_kv=False)
    if mix.early:
        yield dataclasses.replace(mix, early=False)
    if mix.max_num_seqs != 256:
        yield dataclasses.replace(mix, max_num_seqs=256)
    for i in range(len(mix.rows)):
        if len(mix.rows) > 1:
            yield dataclasses.replace(mix, rows=_without_row(mix.rows, i))
    for i, r in enumerate(mix.rows):
        edits = [dataclasses.replace(r, images=r.images[:j] + r.images[j + 1:]) for j in range(len(r.images))]
        if r.adapter is not None and (mix.policy_lora or sum(x.adapter is not None for x in mix.rows) > 1):
            edits.append(dataclasses.replace(r, adapter=None))
        if r.n > 1:
            edits.append(dataclasses.replace(r, n=1))
        if r.wave:
            edits.append(dataclasses.replace(r, wave=0))
        if r.follows is not None:
            edits.append(dataclasses.replace(r, follows=None))
        for e in edits:
            yield dataclasses.replace(mix, rows=mix.rows[:i] + [e] + mix.rows[i + 1:])


def _without_row(rows, i):
    out = []
    for j, r in enumerate(rows):
        if j != i:
            f = r.follows
            out.append(dataclasses.replace(r, follows=None if f == i else (f - 1 if f is not None and f > i else f)))
    return out


def _has_images(mix: Mix, i: int) -> bool:
    r = mix.rows[i]
    return bool(r.images) or (r.follows is not None and _has_images(mix, r.follows))


def shrink(mix: Mix, checks: set[str], budget: int = 40) -> Mix:
    """The smallest mix (one step at a time) that still fails one of ``checks``."""
    tries = 0
    progress = True
    while progress and tries < budget:
        progress = False
        for cand in _smaller(mix):
            tries += 1
            if {c for c, _ in run_mix(cand)} & checks:
                mix, progress = cand, True
                break
            if tries >= budget:
                break
    return mix


def describe(mix: Mix, failures) -> str:
    lines = [f"differential mix seed={mix.seed} family={mix.family} policy_lora={mix.policy_lora} "
             f"chunk={mix.chunk} block_size={mix.block_size} small_kv={mix.small_kv} events={mix.events} "
             f"early={mix.early} backend={mix.backend} max_num_seqs={mix.max_num_seqs}"]
    lines += [f"  row {i}: {r}" for i, r in enumerate(mix.rows)]
    lines += [f"  FAILED {c}: {m}" for c, m in failures]
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m unsloth_rollout.testing.differential --seed S [--count N] [--family F ...] [--all]``: run mixes,
    print each failing one with its shrunk form; exit status 1 when any failed."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--count", type=int, default=1, help="mixes to run")
    p.add_argument("--family", action="append", help="draw only from these families (repeatable)")
    p.add_argument("--all", action="store_true", help="run draws that hit a KNOWN defect too")
    args = p.parse_args(argv)
    failed = 0
    for seed in range(args.seed, args.seed + args.count):
        mix = draw_mix(seed, args.family)
        known = known_defects(mix)
        if known and not args.all:
            print(f"seed {seed}: skipped, known {known}")
            continue
        failures = [f for f in run_mix(mix) if args.all or f[0] not in KNOWN]
        if not failures:
            print(f"seed {seed}: ok ({mix.family}, {len(mix.rows)} rows, events {mix.events})")
            continue
        failed += 1
        small = shrink(mix, {c for c, _ in failures})
        print(describe(mix, failures) + "\nshrunk to:\n" + describe(small, run_mix(small)), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
