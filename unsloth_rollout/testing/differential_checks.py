"""The oracles of the differential test (``unsloth_rollout.testing.differential``), one sample at a time.

All run on the reference model (``FamilyModels.reference``), never on the policy the engine served: HF
``generate()`` for greedy rows, a teacher-forced forward of the weights (version) and adapter each token came from
for every logprob and top logprob, the same request run alone for seeded rows.
"""

from __future__ import annotations

import numpy as np
import torch

from .oracles import teacher_forced

TOL = 1e-5


def tolerance(temperature: float) -> float:
    """The logprob bound at a temperature: ``TOL`` on the raw logits' fp32 noise, which ``log_softmax(z / T)``
    scales by 1/T, so ``TOL / T`` below T = 1 (T = 0.7: 1.43e-5) and ``TOL`` at or above it."""
    return TOL / min(1.0, temperature)


def make_images(sizes, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in sizes]


def processor_inputs(policy, messages, images) -> dict:
    """The processor's own encoding of a chat request (what a trainer would feed the model)."""
    text = policy.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return dict(policy.processor(text=[text], images=[images] if images else None, return_tensors="pt"))


def check_rows(fm, mix, reqs, outs, alone, suppress, unloaded):
    failures = []
    aborted = {min(i for i, r in enumerate(mix.rows) if r.wave == 0)} if "abort" in mix.events and any(
        r.wave == 0 for r in mix.rows) else set()
    for i, samples in outs.items():
        row, req = mix.rows[i], reqs[i]
        where = f"row {i} ({row.kind}, adapter={row.adapter}, {len(row.images)} image(s))"
        enc = None
        if fm.is_vlm:
            enc = processor_inputs(fm.reference, req.messages, req.images)
        for s in samples:
            if s.error is not None:
                ok = ("fail" in mix.events and "InjectedFailure" in s.error) or (
                    unloaded is not None and row.adapter == unloaded and "unloaded" in s.error)
                if not ok:
                    failures.append(("row_error", f"{where} sample {s.sample_index}: {s.error}"))
                    continue
            elif s.finish_reason == "abort" and i not in aborted:
                failures.append(("row_error", f"{where}: aborted without an error or an abort event"))
            if enc is not None and s.prompt_ids != enc["input_ids"][0].tolist():
                failures.append(("prompt", f"{where}: the engine's prompt differs from the processor's"))
                continue
            if s.output_kv_versions != s.output_versions:  # recompute_on_weight_change: no stale KV attended
                failures.append(("versions", f"{where}: kv versions {s.output_kv_versions} != {s.output_versions}"))
            failures += _check_logprobs(fm, row, req, s, enc, where)
            if row.kind == "greedy" and len(set(s.output_versions)) <= 1:
                want = _hf_greedy(fm, row, req, enc, suppress, s.output_versions[0] if s.output_versions else 0)
                complete = s.error is None and s.finish_reason in ("stop", "length")
                if s.output_ids != (want if complete else want[: len(s.output_ids)]):
                    failures.append(("greedy", f"{where}: engine {s.output_ids} != HF generate {want}"))
            if row.kind == "seeded" and i in alone:
                ref = alone[i][s.sample_index]
                k = sum(1 for v in s.output_versions if v == 0)  # tokens before any weight change
                complete = s.error is None and s.finish_reason in ("stop", "length") and k == len(s.output_ids)
                if (s.output_ids if complete else s.output_ids[:k]) != (ref if complete else ref[:k]):
                    failures.append(("seeded", f"{where} sample {s.sample_index}: in the mix {s.output_ids}, "
                                               f"alone {ref}"))
    fm.set_reference_version(max((v for ss in outs.values() for s in ss for v in s.output_versions), default=0))
    return failures


def _vision(enc):
    return {k: v for k, v in (enc or {}).items() if k not in ("input_ids", "attention_mask")}


def _check_logprobs(fm, row, req, s, enc, where):
    if not s.output_ids:
        return []
    got = torch.tensor(s.output_logprobs, dtype=torch.float64)
    if not torch.isfinite(got).all():
        return [("logprobs", f"{where}: non-finite logprobs {s.output_logprobs}")]
    temp = 1.0 if row.sampling.get("temperature", 1.0) < 1e-5 else row.sampling["temperature"]
    tol, worst = tolerance(temp), 0.0
    for v in sorted(set(s.output_versions)):
        fm.set_reference_version(v)
        with fm.reference_adapter(row.adapter) as ref:
            want, logits = teacher_forced(ref, s.prompt_ids, s.output_ids, temp, **_vision(enc))
        at = [j for j, x in enumerate(s.output_versions) if x == v]
        worst = max(worst, (got[at] - want.double()[at]).abs().max().item())
        if s.top_logprobs is not None:  # the top-k alternatives: the k largest of the same distribution
            top = torch.log_softmax(logits / temp, dim=-1).topk(row.sampling["logprobs"], dim=-1)
            for j in at:
                exp = dict(zip(top.indices[j].tolist(), top.values[j].tolist()))
                have = s.top_logprobs[j]
                if set(have) != set(exp) or max(abs(have[t] - exp[t]) for t in exp) > tol:
                    return [("top_logprobs", f"{where} sample {s.sample_index} token {j}: {have} != {exp}")]
    if not worst <= tol:
        return [("logprobs", f"{where} sample {s.sample_index}: logprob drift {worst:.2e} from a teacher-forced "
                             f"forward of the weights and adapter it used (bound {tol:.2e})")]
    return []


def _hf_greedy(fm, row, req, enc, suppress, version):
    fm.set_reference_version(version)
    with fm.reference_adapter(row.adapter) as ref, torch.no_grad():
        if enc is None:
            ids = torch.tensor([req.input_ids])
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            inputs = dict(enc)
        ref.clear_rope_deltas()
        out = ref.model.generate(**inputs, max_new_tokens=row.sampling["max_new_tokens"], do_sample=False,
                                 suppress_tokens=suppress or None)
        ref.clear_rope_deltas()
    return out[0, inputs["input_ids"].shape[1]:].tolist()
