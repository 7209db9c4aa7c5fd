"""The CPU decode attention kernel (engine/cpu_kernel.py) against independent oracles: a float64 softmax
attention written here, SDPA with the engine's mask, the engine's own SDPA path (same tokens, logprobs within
float32 noise of a teacher-forced forward), and torch.compile (the custom op inside the compiled step)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from unsloth_rollout.engine.decode import cpu_kernel
from unsloth_rollout.engine.config import DecodeConfig
from unsloth_rollout.engine.config import EngineConfig

LINUX_GXX = sys.platform.startswith("linux") and shutil.which("g++") is not None


def _reference(q, k, v, lo, hi, scale):
    """float64 softmax(scale * q . k) v over keys lo[b] .. hi[b] - 1 of each row, GQA as repeat_kv maps heads."""
    b, h, _, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = torch.zeros(b, kvh, g, d, dtype=torch.float64)
    lse = torch.full((b, kvh, g), float("-inf"), dtype=torch.float64)
    for i in range(b):
        a, e = int(lo[i]), int(hi[i])
        qi = q[i, :, 0].double().view(kvh, g, d)
        s = torch.einsum("hgd,hld->hgl", qi, k[i, :, a:e].double()) * scale
        lse[i] = torch.logsumexp(s, -1)
        out[i] = torch.einsum("hgl,hld->hgd", torch.softmax(s, -1), v[i, :, a:e].double())
    return out, lse


def _case(b, kvh, g, d, cap, lengths, seed=0, strided=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, kvh * g, 1, d, generator=gen)
    if strided:  # the workspace's layout: rows x heads x capacity x dim, viewed up to the step's key length
        k = torch.randn(b + 3, kvh, cap + 5, d, generator=gen)[1:b + 1, :, :cap]
        v = torch.randn(b + 3, kvh, cap + 5, d, generator=gen)[1:b + 1, :, :cap]
    else:
        k = torch.randn(b, kvh, cap, d, generator=gen) * 2
        v = torch.randn(b, kvh, cap, d, generator=gen)
    return q, k, v, torch.tensor(lengths)


def test_the_kernel_builds_here():
    """Where CI runs (Linux, g++, torch's libgomp) the kernel must build: otherwise every test below would be
    testing SDPA and the engine would silently run without it. It runs on torch's OpenMP runtime: loading it
    adds no runtime to the process (a second one would be a second thread team fighting torch's for the cores)."""
    if not LINUX_GXX:
        pytest.skip("the kernel is built with g++ on Linux")
    code = ("import torch\n"
            "try:\n"
            "    import sentencepiece  # its wheel carries a GNU OpenMP of its own, under another name\n"
            "except ImportError:\n"
            "    pass\n"
            "def gomp():\n"
            "    return {l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l.rsplit('/', 1)[-1]}\n"
            "before = gomp()\n"
            "from unsloth_rollout.engine.decode import cpu_kernel as c\n"
            "assert c.available(), c.build_error()\n"
            "assert gomp() == before, (before, gomp())\n"
            "from unsloth_rollout.kernels.build import openmp_runtime\n"
            "import os\n"
            "torch_root = os.path.realpath(torch.__file__).rsplit('/', 2)[0]\n"
            "assert os.path.realpath(openmp_runtime()).startswith(torch_root), openmp_runtime()\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert cpu_kernel.available(), cpu_kernel.build_error()


needs_kernel = pytest.mark.skipif(not (LINUX_GXX and cpu_kernel.available()), reason="kernel not built")


@needs_kernel
def test_the_op_is_registered_in_cpp_and_its_python_fallback_agrees_bitwise(tmp_path):
    """Here the op ``unsloth_rollout::decode_attention`` is the C++ registration (no Python frame per call, in
    eager and in a compiled graph's wrapper). Where that library cannot build, the op is a Python custom op over
    the same kernel: a process whose torch-header build fails computes bitwise the same outputs, eager and
    compiled, and refuses a bad key range with the same message."""
    assert cpu_kernel.op_registration() == "c++"
    code = ("import sys, torch\n"
            "import unsloth_rollout.kernels.build as b\n"
            "def no_headers():\n"
            "    raise RuntimeError('no torch headers here')\n"
            "b._torch_flags = no_headers\n"
            "from unsloth_rollout.engine.decode import cpu_kernel as c\n"
            "assert c.available(), c.build_error()\n"
            "assert c.op_registration().startswith('python: RuntimeError: no torch headers'), c.op_registration()\n"
            "q, k, v, lens = torch.load(sys.argv[1])\n"
            "lo, hi = c.key_range(lens, None)\n"
            "eager = c.decode_attention(q, k, v, lo, hi, None)\n"
            "compiled = torch.compile(lambda *a: c.decode_attention(*a, None), fullgraph=True)(q, k, v, lo, hi)\n"
            "try:\n"
            "    c.decode_attention(q, k, v, lo, hi + 1, None)\n"
            "except RuntimeError as e:\n"
            "    assert 'outside the keys' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('a range past the keys was read')\n"
            "pk, pv, pe, plen = torch.load(sys.argv[3])\n"
            "pre = c.decode_attention_prefixed(q, k, v, lo, hi, pk, pv, pe, plen, None)\n"
            "pre_c = torch.compile(lambda *a: c.decode_attention_prefixed(*a, None), fullgraph=True)(\n"
            "    q, k, v, lo, hi, pk, pv, pe, plen)\n"
            "torch.save([eager, compiled, pre, pre_c], sys.argv[2])\n")
    q, k, v, lens = _case(5, 2, 3, 32, 40, [3, 39, 17, 0, 25], seed=4, strided=True)
    torch.save([q, k, v, lens], tmp_path / "in.pt")
    pk, pv = torch.randn(2, 2, 24, 32), torch.randn(2, 2, 24, 32)
    pe, plen = torch.tensor([1, -1, 0, 0, 1]), torch.tensor([24, 9])
    torch.save([pk, pv, pe, plen], tmp_path / "prefix.pt")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pt"), str(tmp_path / "out.pt"),
                        str(tmp_path / "prefix.pt")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (e_out, e_lse), (c_out, c_lse), pre, pre_c = torch.load(tmp_path / "out.pt")
    lo, hi = cpu_kernel.key_range(lens, None)
    out, lse = cpu_kernel.decode_attention(q, k, v, lo, hi, None)
    for other in (e_out, c_out):
        assert torch.equal(out, other)
    for other in (e_lse, c_lse):
        assert torch.equal(lse, other)
    here = cpu_kernel.decode_attention_prefixed(q, k, v, lo, hi, pk, pv, pe, plen, None)
    for other in (pre, pre_c):  # the prefixed op: the same kernel through the Python registration
        assert torch.equal(here[0], other[0]) and torch.equal(here[1], other[1])


@needs_kernel
@pytest.mark.parametrize("d", [16, 32, 48, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 7, 8])
def test_kernel_matches_a_float64_attention(d, g):
    # mixed lengths: one key only, a partial block, whole blocks, one past a block, the capacity
    lengths = [0, 5, 15, 16, 33, 70]
    q, k, v, lens = _case(len(lengths), 2, g, d, 71, lengths, seed=d * 10 + g, strided=(g % 2 == 0))
    lo, hi = cpu_kernel.key_range(lens, None)
    out, lse = cpu_kernel.decode_attention(q, k, v, lo, hi, None)
    ref, ref_lse = _reference(q, k, v, lo, hi, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-6)


def _build_eight_wide(tmp_path):
    """The kernel's source built for 8-float vectors (AVX2, as on a machine without AVX-512), loaded by ctypes."""
    import ctypes

    from unsloth_rollout.kernels import build

    src = os.path.join(os.path.dirname(build.__file__), "csrc", "decode_attention.cpp")
    out = tmp_path / "decode_attention_avx2.so"
    cmd = ["g++", "-O3", "-march=native", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC", src, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.decode_attention_f32.argtypes = [p] * 7 + [i] * 11 + [ctypes.c_float, ctypes.c_int]
    lib.decode_attention_f32.restype = ctypes.c_int
    return lib


@needs_kernel
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in open("/proc/cpuinfo").read(),
                    reason="the 8-wide build needs an x86 CPU with AVX2")
def test_the_eight_wide_build_matches_a_float64_attention(tmp_path):
    """Machines without AVX-512 build the kernel with 8-float vectors (its W == 8 branch: other reductions, twice
    the vectors per row); built that way here, it agrees with the float64 attention on every head size."""
    lib = _build_eight_wide(tmp_path)
    lengths = [0, 5, 7, 8, 9, 33, 70]
    for d in (16, 32, 48, 64, 80, 96, 128, 256):
        for g in (1, 2, 4, 7):
            q, k, v, lens = _case(len(lengths), 2, g, d, 71, lengths, seed=d + g, strided=(g % 2 == 0))
            lo, hi = cpu_kernel.key_range(lens, None)
            b = q.shape[0]
            qc = q.reshape(b, 2, g, d).contiguous()
            out, lse = torch.empty_like(qc), torch.empty(b, 2, g)
            rc = lib.decode_attention_f32(qc.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                          lo.data_ptr(), hi.data_ptr(), b, 2, g, d, k.shape[2], *k.stride()[:3],
                                          *v.stride()[:3], d ** -0.5, 2)
            assert rc == 0, (d, g, rc)
            ref, ref_lse = _reference(q, k, v, lo, hi, d ** -0.5)
            torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5, msg=f"d={d} g={g}")
            torch.testing.assert_close(lse.double(), ref_lse, atol=2e-6, rtol=2e-6, msg=f"d={d} g={g}")


@needs_kernel
@pytest.mark.parametrize("window", [None, 1, 7, 16, 40])
def test_kernel_equals_sdpa_with_the_engines_mask(window):
    """What the engine's attention computed before: SDPA over the whole key view with the decode mask (keys
    0..length, within the sliding window)."""
    from unsloth_rollout.engine.attention import ForwardContext

    lengths = [3, 0, 47, 16, 31, 63, 64, 9]
    q, k, v, lens = _case(len(lengths), 2, 2, 16, 65, lengths, seed=window or 0, strided=True)
    ctx = ForwardContext.decode(lens, 65)
    mask = ctx.additive_mask(window, torch.float32)
    b, h, _, d = q.shape
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, 2, 2, d), k, v, attn_mask=mask, scale=0.3)
    out, _ = cpu_kernel.decode_attention(q, k, v, *ctx.key_range(window), 0.3)
    torch.testing.assert_close(out, sdpa, atol=1e-6, rtol=1e-5)


@needs_kernel
def test_kernel_runs_as_one_op_inside_torch_compile_without_recompiling():
    """The compiled step calls it as the custom op ``unsloth_rollout::decode_attention``: same output as
    eager, the keys read through the strided view (no copy), and one graph for every batch and key length."""
    from torch._dynamo.utils import counters

    def step(q, k, v, lens):
        lo, hi = cpu_kernel.key_range(lens, None)
        return cpu_kernel.decode_attention(q, k, v, lo, hi, 0.25)[0] * 2

    fn = torch.compile(step, dynamic=True, fullgraph=True)
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for b, cap, seed in ((5, 40, 1), (7, 90, 2), (3, 129, 3)):  # b never equals the 4 heads (duck sizing)
        lengths = torch.randint(0, cap, (b,), generator=torch.Generator().manual_seed(seed)).tolist()
        q, k, v, lens = _case(b, 2, 2, 16, cap, lengths, seed=seed, strided=True)
        got = fn(q, k, v, lens)
        torch.testing.assert_close(got, step(q, k, v, lens), atol=0, rtol=0)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_shapes_outside_the_kernel_are_left_to_sdpa():
    q = torch.randn(2, 4, 1, 16)
    k = v = torch.randn(2, 2, 8, 16)
    assert cpu_kernel.supported(q, k, v)
    assert not cpu_kernel.supported(q.bfloat16(), k.bfloat16(), v.bfloat16())  # float32 only
    assert not cpu_kernel.supported(torch.randn(2, 4, 1, 8), torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8))
    assert not cpu_kernel.supported(torch.randn(2, 18, 1, 16), k, v)  # 9 query heads per KV head
    assert not cpu_kernel.supported(torch.randn(2, 4, 2, 16), k, v)  # two query positions: not decode
    assert not cpu_kernel.supported(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v)  # strided dim


def test_the_setting_is_validated_by_name():
    with pytest.raises(ValueError, match="decode.cpu_kernel"):
        EngineConfig(decode=DecodeConfig(cpu_kernel="yes"))


@needs_kernel
def test_engine_tokens_and_logprobs_with_and_without_the_kernel(qwen2_dir):
    """The same requests through the engine with the kernel and with SDPA: the same greedy tokens, logprobs within
    float32 noise of each other and of a teacher-forced forward (the independent oracle), mixed lengths, GQA."""
    from unsloth_rollout import GenerationRequest, RolloutEngine, SamplingParams, load_model
    from unsloth_rollout.testing.oracles import teacher_forced

    policy = load_model(qwen2_dir, backend="transformers")
    prompts = [policy.tokenizer.encode("alice counts twelve apples " * r) for r in (1, 4, 9)]
    runs = {}
    for kernel in (False, True):
        engine = RolloutEngine(policy, EngineConfig(kv_cache_memory_bytes=64 << 20,
                                                    decode=DecodeConfig(cpu_kernel=kernel)))
        try:
            assert engine.stats()["cpu_attention_kernel"] is kernel
            runs[kernel] = engine.generate([GenerationRequest(input_ids=p, sampling=SamplingParams(
                max_new_tokens=24, temperature=0, ignore_eos=True)) for p in prompts])
        finally:
            engine.shutdown()
    for a, b, p in zip(runs[False], runs[True], prompts):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=2e-5,
                                   rtol=0)
        ref, _ = teacher_forced(policy, p, b.output_ids)
        torch.testing.assert_close(torch.tensor(b.output_logprobs), ref, atol=3e-5, rtol=0)


def test_the_environment_switch_turns_it_off(qwen2_dir):
    code = ("from unsloth_rollout import load_model; from unsloth_rollout.engine.core import EngineCore; "
            "from unsloth_rollout.engine.config import EngineConfig; import sys; "
            f"p = load_model({str(qwen2_dir)!r}, backend='transformers'); "
            "c = EngineCore(p, EngineConfig(kv_cache_memory_bytes=8 << 20)); print(c.runner.kernel)")
    env = dict(os.environ, UNSLOTH_ROLLOUT_CPU_KERNEL="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64", "aarch64"), reason="built for x86-64 / arm64")
def test_a_failed_build_leaves_sdpa_and_says_why(tmp_path):
    """No compiler: the kernel is unavailable, build_error() names the cause, nothing raises."""
    code = ("import torch; from unsloth_rollout.engine.decode import cpu_kernel as c; "
            "print(c.available()); print(c.build_error())")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), UNSLOTH_ROLLOUT_KERNEL_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2] == "False" and "no-such-compiler" in lines[-1]


@needs_kernel
@pytest.mark.parametrize("b,g,d,keys", [(32, 4, 64, 2048), (64, 2, 16, 272)])
def test_kernel_is_no_further_from_float64_than_sdpa(b, g, d, keys):
    """On the long workload's and the 36-layer bench's shapes (full rows): the kernel's largest error against a
    float64 attention is no larger than SDPA's (benchmarks/README.md quotes the first shape's)."""
    from unsloth_rollout.engine.attention import ForwardContext

    q, k, v, lens = _case(b, 2, g, d, keys, [keys - 1] * b, seed=1)
    q, k = q * 3, k * 1.5  # sharper softmaxes than unit-variance noise gives
    lo, hi = cpu_kernel.key_range(lens, None)
    ref, _ = _reference(q, k, v, lo, hi, d ** -0.5)
    out, _ = cpu_kernel.decode_attention(q, k, v, lo, hi, None)
    mask = ForwardContext.decode(lens, keys).additive_mask(None, torch.float32)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, 2, g, d), k, v, attn_mask=mask)
    err_kernel, err_sdpa = (out.double() - ref).abs().max().item(), (sdpa.double() - ref).abs().max().item()
    print(f"max |error| vs float64: kernel {err_kernel:.2e}, sdpa {err_sdpa:.2e}")
    assert err_kernel <= err_sdpa


@needs_kernel
def test_a_key_range_outside_the_keys_is_refused_not_read():
    """The kernel reads raw memory: a row whose range reaches past the keys it was given raises instead."""
    q, k, v, lens = _case(3, 2, 2, 16, 10, [3, 9, 4])
    lo, hi = cpu_kernel.key_range(lens, None)
    cpu_kernel.decode_attention(q, k, v, lo, hi, None)
    with pytest.raises(RuntimeError, match="outside the keys"):
        cpu_kernel.decode_attention(q, k, v, lo, hi + 1, None)
    with pytest.raises(RuntimeError, match="outside the keys"):
        cpu_kernel.decode_attention(q, k, v, lo - 1, hi, None)


@needs_kernel
@pytest.mark.parametrize("d,g", [(16, 2), (64, 4), (128, 7)])
def test_the_prefixed_op_matches_a_float64_attention_over_entry_then_own_keys(d, g):
    """``decode_attention_prefixed``: row b attends to prefix entry pe[b]'s first plen keys, then to its own keys
    lo .. hi - 1, under one softmax. Oracle: the float64 attention over the two concatenated; rows without an entry
    equal the plain op bitwise; the compiled op equals the eager one; an entry or length outside the store is
    refused, not read."""
    gen = torch.Generator().manual_seed(1)
    b, kvh, cap, e, p = 6, 2, 40, 3, 50
    q, k, v, _ = _case(b, kvh, g, d, cap, [0] * b, seed=2, strided=True)
    pk = torch.randn(e + 1, kvh, p + 3, d, generator=gen)[:e, :, :p]  # the store's layout: entries x heads x cap
    pv = torch.randn(e + 1, kvh, p + 3, d, generator=gen)[:e, :, :p]
    pe, plen = torch.tensor([0, 0, -1, 2, 2, 1]), torch.tensor([33, 17, 48])
    lo, hi = torch.tensor([0, 0, 0, 0, 5, 0]), torch.tensor([5, 9, 40, 1, 23, 30])
    scale = d ** -0.5
    out, lse = cpu_kernel.decode_attention_prefixed(q, k, v, lo, hi, pk, pv, pe, plen, scale)
    for i in range(b):
        j = int(pe[i])
        kk, vv, a, z = k[i:i + 1], v[i:i + 1], int(lo[i]), int(hi[i])
        if j >= 0:  # the entry's keys, then the row's own range, as one row of keys
            n = int(plen[j])
            kk = torch.cat([pk[j:j + 1, :, :n], k[i:i + 1, :, a:z]], 2)
            vv = torch.cat([pv[j:j + 1, :, :n], v[i:i + 1, :, a:z]], 2)
            a, z = 0, kk.shape[2]
        ref, ref_lse = _reference(q[i:i + 1], kk, vv, torch.tensor([a]), torch.tensor([z]), scale)
        assert (out[i].double() - ref[0]).abs().max() <= 2e-6, i
        assert (lse[i].double() - ref_lse[0]).abs().max() <= 2e-5, i
    plain, plain_lse = cpu_kernel.decode_attention(q, k, v, lo, hi, scale)
    alone = pe < 0
    assert torch.equal(out[alone], plain[alone]) and torch.equal(lse[alone], plain_lse[alone])
    compiled = torch.compile(cpu_kernel.decode_attention_prefixed, fullgraph=True)
    assert torch.equal(compiled(q, k, v, lo, hi, pk, pv, pe, plen, scale)[0], out)
    with pytest.raises(RuntimeError, match="prefix entry"):
        cpu_kernel.decode_attention_prefixed(q, k, v, lo, hi, pk, pv, torch.tensor([0, 0, -1, 3, 2, 1]), plen, scale)
    with pytest.raises(RuntimeError, match="prefix entry"):
        cpu_kernel.decode_attention_prefixed(q, k, v, lo, hi, pk, pv, pe, torch.tensor([33, 17, 51]), scale)
