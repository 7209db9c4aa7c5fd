"""The paged decode attention kernel (engine/decode/paged_attention.py, kernels/paged_decode.py) against independent
oracles: a float64 attention written here over keys gathered through the block table, and SDPA over the same keys
with the engine's own decode mask (``ForwardContext.mask``). On a machine without CUDA the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1`` in the environment: torch._dynamo imports triton early).

The pool is the engine's ``KVCache``; every slot no row attends to (the unused tail of a row's last block, unused
blocks, the scratch block padded rows point at) holds NaN, so a kernel that read past a row's keys, or read a
padded row at all, would put NaN in its output. Tolerances: float32 within 1e-5 (absolute and relative) of the
float64 oracle; float16 (the softmax weights rounded to float16 before the weighted sum, as flash attention does,
and the output rounded to float16) within 2e-3.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections import deque

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without CUDA the kernels run under Triton's interpreter, which triton reads when it is imported (its own jit
# functions, tl.max and the like); torch._dynamo imports triton, and tests/conftest.py imports torch._dynamo, so under
# pytest the variable must come from the environment. Set here when triton is not imported yet; else a skip.
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1" and importlib.util.find_spec("triton") is not None:
    if "triton" in sys.modules:
        pytest.skip("no CUDA device, and triton was imported before TRITON_INTERPRET=1 could be set: run with "
                    "TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from unsloth_rollout.engine.attention import ForwardContext  # noqa: E402
from unsloth_rollout.engine.decode import paged_attention as pa  # noqa: E402
from unsloth_rollout.engine.kv_cache import KVCache  # noqa: E402
from unsloth_rollout.errors import UnsupportedAttentionError  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cdiv(a, b):
    return -(-a // b)


def _case(page, kvh, g, d, lengths, dtype=torch.float32, seed=0, poison=True, layers=1, extra_width=2):
    """(pool KVCache, q [B, H, D], block_tables [B, W] int32, lengths [B] int32): each row's blocks taken from a
    shuffled free list, padded with the scratch block; keys 0 .. n-1 of every row random, every other slot NaN
    (``poison``) or random."""
    gen = torch.Generator().manual_seed(seed)
    need = [_cdiv(n, page) for n in lengths]
    kv = KVCache(layers, kvh, d, sum(need) + 3, page, dtype, torch.device("cpu"))
    kv.free_blocks = deque(torch.randperm(kv.num_blocks, generator=gen).tolist())
    width = max(need) + extra_width
    scratch = kv.num_blocks  # the block past the usable ones (KVCache.scratch_slot // page)
    tables = torch.full((len(lengths), width), scratch, dtype=torch.int32)
    for layer in range(layers):
        for pool in (kv.k[layer], kv.v[layer]):
            if poison:
                pool.fill_(float("nan"))
            else:
                pool.copy_(torch.randn(pool.shape, generator=gen))
    for i, n in enumerate(lengths):
        blocks = kv.allocate(need[i])
        tables[i, :need[i]] = torch.tensor(blocks, dtype=torch.int32)
        slots = kv.slots(blocks, 0, n)
        for layer in range(layers):
            kv.k[layer][slots] = (1.5 * torch.randn(n, kvh, d, generator=gen)).to(dtype)
            kv.v[layer][slots] = torch.randn(n, kvh, d, generator=gen).to(dtype)
    q = torch.randn(len(lengths), kvh * g, d, generator=gen).to(dtype)
    dev = DEVICE
    if CUDA:
        kv.k, kv.v = [t.to(dev) for t in kv.k], [t.to(dev) for t in kv.v]
    return kv, q.to(dev), tables.to(dev), torch.tensor(lengths, dtype=torch.int32, device=dev)


def _oracle(q, kp, vp, tables, lengths, page, scale, window=None, softcap=None):
    """float64: every row's keys gathered through its whole block table, the ones it does not attend masked out
    (their slots may hold NaN: masked scores are -inf and masked values 0 before any product)."""
    q, kp, vp, tables, lengths = (t.cpu() for t in (q, kp, vp, tables, lengths))
    b, h, d = q.shape
    kvh = kp.shape[1]
    g = h // kvh
    pos = torch.arange(tables.shape[1] * page)
    slots = tables.long()[:, pos // page] * page + pos % page  # [B, L]
    n = lengths.long().unsqueeze(1)
    attend = pos.unsqueeze(0) < n
    if window is not None:
        attend &= pos.unsqueeze(0) >= n - window
    keys = kp.double()[slots].masked_fill(~attend[:, :, None, None], 0.0)  # [B, L, KV, D]
    values = vp.double()[slots].masked_fill(~attend[:, :, None, None], 0.0)
    s = torch.einsum("bkgd,blkd->bkgl", q.double().view(b, kvh, g, d), keys) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~attend[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # -inf for a row with no key
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bkgl,blkd->bkgd", p, values)
    return out.reshape(b, h, d), lse.reshape(b, h)


def _check(out, lse, ref_out, ref_lse, lengths, dtype):
    tol = TOL[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=tol, atol=tol)
    real = lengths.cpu() > 0
    torch.testing.assert_close(lse.cpu().double()[real], ref_lse[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out.cpu()[~real], torch.zeros_like(out.cpu()[~real]))
    assert bool((lse.cpu()[~real] == float("-inf")).all())


# (page, KV heads, query heads per KV head, head dim, dtype, window, softcap, (splits, keys per tile)): the default
# launch (8 splits of 64-key tiles: one tile per split at these lengths) and (2, 16) (up to 10 tiles a split: the
# online softmax rescales across tiles)
DEFAULT, TILED = (pa.DEFAULT_SPLITS, 64), (2, 16)
CASES = [
    (8, 2, 1, 64, torch.float32, None, None, DEFAULT),
    (16, 2, 2, 128, torch.float32, None, None, TILED),
    (8, 1, 4, 80, torch.float32, None, None, DEFAULT),  # head dim 80: padded to 128 inside, masked
    (16, 2, 7, 64, torch.float32, None, None, TILED),
    (8, 2, 4, 64, torch.float32, 5, None, DEFAULT),  # window shorter than a page
    (16, 1, 7, 64, torch.float32, None, 2.0, TILED),  # a softcap that bites (scores ~N(0, 1.5))
    (8, 2, 2, 64, torch.float32, 100, 30.0, TILED),
    (8, 2, 4, 64, torch.float16, None, None, DEFAULT),
    (16, 2, 7, 128, torch.float16, 9, 2.0, TILED),
]


@pytest.mark.parametrize("page,kvh,g,d,dtype,window,softcap,launch", CASES,
                         ids=[f"p{c[0]}-kv{c[1]}-g{c[2]}-d{c[3]}-{str(c[4])[6:]}-w{c[5]}-cap{c[6]}-s{c[7][0]}"
                              for c in CASES])
def test_the_kernel_matches_a_float64_attention(page, kvh, g, d, dtype, window, softcap, launch):
    """Lengths 1, page-1, page, page+1, 300 and a padded row (0) in one batch, blocks scattered over the pool."""
    lengths = [1, page - 1, page, page + 1, 300, 0]
    kv, q, tables, lens = _case(page, kvh, g, d, lengths, dtype, seed=page + g + d)
    scale = d ** -0.5
    out, lse = pa.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, scale, page=page, window=window,
                                         softcap=softcap, num_splits=launch[0], block_n=launch[1])
    ref_out, ref_lse = _oracle(q, kv.k[0], kv.v[0], tables, lens, page, scale, window, softcap)
    _check(out, lse, ref_out, ref_lse, lens, dtype)
    # the module's own float64 reference (what benchmarks/gpu/paged_attention_check.py compares with) agrees too
    m_out, m_lse = pa.reference(q, kv.k[0], kv.v[0], tables, lens, scale, page=page, window=window, softcap=softcap)
    torch.testing.assert_close(m_out, ref_out, rtol=1e-9, atol=1e-9)  # float64 summed in another order
    torch.testing.assert_close(m_lse, ref_lse, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("window", [None, 7])
def test_the_kernel_matches_sdpa_with_the_engine_mask(window):
    """SDPA over the gathered keys with ``ForwardContext``'s decode mask (query position n-1, keys 0 .. n-1, the
    last ``window`` under a sliding window): the engine's gather step computes exactly this."""
    page, kvh, g, d = 16, 2, 4, 64
    lengths = [1, 15, 16, 17, 300, 40]
    kv, q, tables, lens = _case(page, kvh, g, d, lengths, poison=False, seed=3)
    out, lse = pa.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, page=page, window=window)
    key_len = tables.shape[1] * page
    pos = torch.arange(key_len, device=tables.device)
    slots = tables.long()[:, pos // page] * page + pos % page
    keys = kv.k[0][slots].permute(0, 2, 1, 3)  # [B, KV, L, D], as the gather step's view returns them
    values = kv.v[0][slots].permute(0, 2, 1, 3)
    ctx = ForwardContext.decode(lens.long() - 1, key_len)  # each row's new token sits at position n - 1
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=ctx.additive_mask(window, q.dtype), enable_gqa=True)
    torch.testing.assert_close(out, ref[:, :, 0], rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(lse).all())


def test_the_split_count_does_not_change_the_result():
    """1, 2 and 64 splits (64: more splits than a short row has keys, so most are empty) against the oracle."""
    page, kvh, g, d = 8, 2, 2, 64
    kv, q, tables, lens = _case(page, kvh, g, d, [1, 3, 9, 130, 0], seed=5)
    ref_out, ref_lse = _oracle(q, kv.k[0], kv.v[0], tables, lens, page, d ** -0.5)
    for splits in (1, 2, 64):
        out, lse = pa.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, page=page, num_splits=splits,
                                             block_n=16)
        _check(out, lse, ref_out, ref_lse, lens, torch.float32)


def test_a_batch_of_padded_rows_reads_nothing():
    """A bucket's padding rows (length 0, block tables on the NaN scratch block): outputs 0, log-sum-exps -inf."""
    kv, q, tables, lens = _case(8, 2, 4, 64, [0, 0, 0, 5], seed=6)
    tables[:3] = kv.num_blocks
    out, lse = pa.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, page=8)
    ref_out, ref_lse = _oracle(q, kv.k[0], kv.v[0], tables, lens, 8, 64 ** -0.5)
    _check(out, lse, ref_out, ref_lse, lens, torch.float32)


def test_the_engine_s_attention_call_reads_a_strided_query_and_a_later_layer():
    """``attend`` as the engine's attention calls it: the query ``[B, H, 1, D]`` as a transpose of the projection's
    ``[B, 1, H, D]`` (head-strided), layer 1 of a two-layer pool, the output ``[B, 1, H, D]``."""
    page, kvh, g, d = 16, 2, 2, 64
    kv, _, tables, lens = _case(page, kvh, g, d, [5, 33, 0], layers=2, seed=7)
    proj = torch.randn(3, 1, kvh * g, d, device=DEVICE)
    query = proj.transpose(1, 2)  # [B, H, 1, D], not contiguous
    paged = pa.PagedDecode(kv.k, kv.v, page, tables, lens)
    out = pa.attend(query, 1, paged, None, 0.3, None)
    assert out.shape == (3, 1, kvh * g, d)
    ref_out, _ = _oracle(proj[:, 0], kv.k[1], kv.v[1], tables, lens, page, 0.3)
    torch.testing.assert_close(out[:, 0].cpu().double(), ref_out, rtol=1e-5, atol=1e-5)


def test_shapes_and_values_the_kernel_cannot_serve_are_refused_by_name():
    kv, q, tables, lens = _case(8, 2, 2, 64, [3, 9], poison=False)
    k, v = kv.k[0], kv.v[0]

    def call(**kw):
        args = dict(q=q, k_pool=k, v_pool=v, block_tables=tables, lengths=lens, page=8)
        args.update(kw)
        return pa.paged_decode_attention(**args)

    big = torch.zeros(2, 4, 272)
    refusals = [
        (dict(q=big, k_pool=torch.zeros(16, 2, 272), v_pool=torch.zeros(16, 2, 272)), "head dim 272 is over 256"),
        (dict(q=torch.zeros(2, 130, 64), k_pool=torch.zeros(16, 2, 64), v_pool=torch.zeros(16, 2, 64)),
         "65 query heads per KV head"),
        (dict(q=torch.zeros(2, 3, 64)), "not a multiple of 2 KV heads"),
        (dict(q=q[..., :32]), "query head dim 32 != pool head dim 64"),
        (dict(q=q.double()), "float32, float16 or bfloat16 only"),
        (dict(num_splits=3), "num_splits=3 is not a power of two"),
        (dict(block_n=8), "block_n=8"),
        (dict(block_tables=tables.long()), "block_tables must be int32"),
        (dict(lengths=lens.long()), "lengths must be int32"),
        (dict(window=0), "sliding window 0"),
        (dict(softcap=0.0), "softcap 0.0 is not positive"),
        (dict(page=5), "whole pages of 5"),
    ]
    if not CUDA:
        refusals.append((dict(q=q.bfloat16(), k_pool=k.bfloat16(), v_pool=v.bfloat16()), "bfloat16 under Triton's "
                                                                                          "interpreter"))
    for kw, words in refusals:
        with pytest.raises(UnsupportedAttentionError, match=words.replace("(", r"\(")):
            call(**kw)
    with pytest.raises(ValueError, match="outside 0 .. 32"):
        call(lengths=torch.tensor([3, 33], dtype=torch.int32, device=lens.device))
    bad = tables.clone()
    bad[1, 0] = kv.num_blocks + 1  # past the scratch block: outside the pool
    with pytest.raises(ValueError, match="outside the pool"):
        call(block_tables=bad)


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    if CUDA:
        pytest.skip("on a CUDA machine CPU tensors are refused the same way; this checks the message on CPU")
    kv, q, tables, lens = _case(8, 1, 1, 64, [3], poison=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pa.available() is CUDA
    with pytest.raises(UnsupportedAttentionError, match="runs on CUDA"):
        pa.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, page=8)


def test_split_counts_follow_the_bucket_shape_only():
    assert [pa.splits_for(b, 2) for b in (1, 2, 64, 128, 256)] == [64, 64, 4, 2, 1]
    assert pa.splits_for(1, 16) == 32 and pa.splits_for(3, 1) == 64


def test_importing_the_engine_builds_no_kernel():
    """The binding is imported with the engine's attention on every path; the Triton kernels' module (and triton
    with it, where torch has not imported it already) only when a kernel is launched."""
    code = ("import sys\n"
            "from unsloth_rollout.engine import attention\n"
            "from unsloth_rollout.engine.decode import paged_attention as pa\n"
            "pa.available()\n"
            "assert 'unsloth_rollout.kernels.paged_decode' not in sys.modules\n"
            "assert pa.built_interpreted() is None\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ============================================================================ the engine's paged step
def test_the_paged_step_is_refused_where_its_kernel_cannot_run(monkeypatch):
    from unsloth_rollout.engine.decode.paged import check_device

    check_device(DEVICE)  # runs here: CUDA, or the interpreter on CPU
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not CUDA:
        with pytest.raises(ValueError, match="decode backend 'paged' needs triton and a CUDA device"):
            check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="needs triton and a CUDA device"):
        check_device(torch.device("meta"))


def _load(family):
    from unsloth_rollout import load_model
    from unsloth_rollout.testing.families import family_model_path
    from unsloth_rollout.testing.oracles import perturb_lora
    from unsloth_rollout.testing.tiny import tiny_model_path

    # Gemma 2: attention soft-capping (1.0) and an 8-token sliding window, in its eager attention
    path, attn = ((tiny_model_path("qwen2"), "sdpa") if family == "qwen2" else (family_model_path(family), "eager"))
    policy = load_model(str(path), backend="transformers", dtype=torch.float32, lora={"r": 8, "random_state": 0},
                        attn_implementation=attn)
    assert perturb_lora(policy.model, std=0.3) > 0
    return policy


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_the_engine_decodes_through_the_paged_step_as_through_the_gather_step(family):
    """``DecodeConfig(backend="paged")``: the engine's attention reads the pool through the kernel (the cache view
    returns only the new keys). Rows of mixed lengths, 8-token blocks, 12 new tokens (past Gemma 2's window):
    greedy tokens equal the gather step's (a float32 near-tie excepted), logprobs within 1e-5 of them, and within
    the parity bound of a teacher-forced forward."""
    from unsloth_rollout import EngineConfig, GenerationRequest, RolloutEngine, SamplingParams
    from unsloth_rollout.engine.config import DecodeConfig
    from unsloth_rollout.testing.oracles import assert_greedy_matches, parity_bound, teacher_forced_logprobs

    policy = _load(family)
    tok = policy.tokenizer
    texts = ["the cat", "alice counts twelve red apples in the old market", "one two three four five six seven",
             "Bob and Carol walk to Paris before the rain starts and then"]
    prompts = [tok.encode(t) for t in texts]
    assert min(map(len, prompts)) < 8 < max(map(len, prompts))
    reqs = [GenerationRequest(input_ids=p, sampling=SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True))
            for p in prompts]
    outs = {}
    for backend in ("gather", "paged"):
        engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=4 << 20, block_size=8,
                                                    decode=DecodeConfig(backend=backend)), seed=0)
        try:
            outs[backend] = engine.generate(reqs)
            assert engine.stats()["decode_backend"] == backend
        finally:
            engine.shutdown()
    drift = gather_drift = 0.0
    with torch.no_grad():
        for p, g, q in zip(prompts, outs["gather"], outs["paged"]):
            assert_greedy_matches(policy, p, q.output_ids, g.output_ids, label=family)
            if q.output_ids != g.output_ids:
                continue
            got, want = torch.tensor(q.output_logprobs), torch.tensor(g.output_logprobs)
            assert torch.isfinite(got).all()
            assert (got - want).abs().max().item() <= 1e-5, (family, (got - want).abs().max().item())
            ref, _ = teacher_forced_logprobs(policy, p, q.output_ids)
            drift = max(drift, (got - ref).abs().max().item())
            gather_drift = max(gather_drift, (want - ref).abs().max().item())
    assert drift <= parity_bound(gather_drift), (family, drift, gather_drift)
