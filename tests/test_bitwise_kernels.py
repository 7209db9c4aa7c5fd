"""The bitwise on-policy mode's CPU kernels (kernels/batch_invariant.py): each output element the same bits whatever
else is computed with it, and the right value.

Oracles: float64 reference computations and torch's own ops (values within float32 rounding), the kernels' own
result for one row at a time (the bits), and plain attention's autograd (gradients).
"""

from __future__ import annotations

import pytest
import torch

from unsloth_rollout import bitwise
from unsloth_rollout.errors import BitwiseModeError
from unsloth_rollout.kernels import batch_invariant as bi

pytestmark = pytest.mark.skipif(not bi.available(), reason=f"no C++ compiler: {bi.build_error()}")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_a_matmul_row_does_not_depend_on_the_rows_beside_it():
    g = _gen()
    w = torch.randn(301, 77, generator=g)  # K not a multiple of 16: the zero-padded lane group
    x = torch.randn(50, 77, generator=g)
    full = bi.linear(x, w)
    assert (full.double() - x.double() @ w.double().T).abs().max() < 1e-4
    for i in (0, 1, 17, 49):
        assert torch.equal(bi.linear(x[i:i + 1], w), full[i:i + 1])
    assert torch.equal(bi.linear(x[3:20], w), full[3:20])
    # the same rows inside a 3-D batch, a transposed left operand and a broadcast batched matmul
    assert torch.equal(bi.linear(x.view(5, 10, 77), w).view(50, 301), full)
    assert torch.equal(bi.matmul(x.T.contiguous().T, w.T), full)
    assert torch.equal(bi.matmul(x.view(2, 25, 77), w.T.unsqueeze(0))[1], full[25:])


def test_reductions_and_softmaxes_do_not_depend_on_the_batch():
    g = _gen(1)
    y = torch.randn(13, 1000, generator=g) * 4
    s = bi.row_sum(y, [1])
    assert (s.double() - y.double().sum(1)).abs().max() < 1e-3
    assert torch.equal(bi.row_sum(y[2:5], [1]), s[2:5])
    assert torch.equal(bi.row_sum(y.T.contiguous(), [0]), s)  # the reduced dimension moved last
    ls = bi.log_softmax(y, -1)
    assert (ls.double() - torch.log_softmax(y.double(), -1)).abs().max() < 1e-5
    assert torch.equal(bi.log_softmax(y[4:6], -1), ls[4:6])
    lse = bi.logsumexp(y, [1])
    assert torch.equal(ls, y - lse.unsqueeze(1))  # log_softmax is x - logsumexp(x): both trainers' formulas agree
    assert (bi.softmax(y, -1).double() - torch.softmax(y.double(), -1)).abs().max() < 1e-6


@pytest.mark.parametrize("name,ref", [("exp", torch.exp), ("silu", torch.nn.functional.silu), ("tanh", torch.tanh),
                                      ("rsqrt", torch.rsqrt), ("gelu", torch.nn.functional.gelu)])
def test_elementwise_functions_are_the_same_bits_at_any_position(name, ref):
    x = torch.randn(1037, generator=_gen(2))
    if name == "rsqrt":
        x = x.abs() + 1
    full = bi.unary(name, x)
    assert (full.double() - ref(x.double())).abs().max() < 1e-5
    for a, b in ((0, 1), (5, 9), (1030, 1037), (16, 48)):
        assert torch.equal(bi.unary(name, x[a:b]), full[a:b])


def _inputs(seed=3, b=2, h=4, kvh=2, q=5, l=9, d=16):
    g = _gen(seed)
    return (torch.randn(b, h, q, d, generator=g), torch.randn(b, kvh, l, d, generator=g),
            torch.randn(b, kvh, l, d, generator=g))


def test_attention_depends_only_on_the_attended_keys_in_order():
    q, k, v = _inputs()
    mask = torch.rand(2, 1, 5, 9, generator=_gen(4)) > 0.3
    mask[..., 0] = True
    out, lse = bi.attention(q, k, v, mask, 0.25)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert (out - ref).abs().max() < 1e-6
    # three masked keys in front (NaN: never read), as a left-padded row: the same bits
    nan = torch.full((2, 2, 3, 16), float("nan"))
    pad_mask = torch.cat([torch.zeros(2, 1, 5, 3, dtype=torch.bool), mask], 3)
    out2, lse2 = bi.attention(q, torch.cat([nan, k], 2), torch.cat([nan, v], 2), pad_mask, 0.25)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # one query alone (a decode step), and a float mask of 0 / -inf
    one, _ = bi.attention(q[:, :, 2:3], k, v, mask[:, :, 2:3], 0.25)
    assert torch.equal(one, out[:, :, 2:3])
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    assert torch.equal(bi.attention(q, k, v, additive, 0.25)[0], out)
    # causal without a mask is the causal mask
    causal, _ = bi.attention(q, k[:, :, :5], v[:, :, :5], None, 0.25, causal=True)
    tril = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 1, 5, 5)
    assert torch.equal(causal, bi.attention(q, k[:, :, :5], v[:, :, :5], tril, 0.25)[0])


def test_attention_refuses_a_score_bias():
    q, k, v = _inputs()
    with pytest.raises(BitwiseModeError, match="bias"):
        bi.attention(q, k, v, torch.full((2, 1, 5, 9), 0.5), 0.25)


def test_attention_gradients_match_plain_attention():
    q, k, v = _inputs(5)
    mask = torch.rand(2, 1, 5, 9, generator=_gen(6)) > 0.3
    mask[..., 0] = True
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = bi.attention(*leaves, mask, 0.25, softcap=2.0)
    out.square().sum().backward()
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    s = (plain[0] @ plain[1].repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
    s = (torch.tanh(s / 2) * 2).masked_fill(~mask, float("-inf"))
    ref = torch.softmax(s, -1) @ plain[2].repeat_interleave(2, 1)
    ref.square().sum().backward()
    assert (out - ref).abs().max() < 1e-5
    for a, b in zip(leaves, plain):
        assert (a.grad - b.grad).abs().max() < 1e-5


def test_the_op_mode_refuses_an_op_it_cannot_make_invariant_and_passes_exact_ones():
    x = torch.randn(4, 8, generator=_gen(7))
    with bitwise.ops():
        assert torch.equal(torch.cumsum(torch.arange(5), 0), torch.tensor([0, 1, 3, 6, 10]))  # integers: as they are
        assert torch.equal(x * 2 + 1, x * 2 + 1)
        with pytest.raises(BitwiseModeError, match="cumsum"):
            torch.cumsum(x, 1)
        with pytest.raises(BitwiseModeError, match="std"):
            torch.std(x)
        y = torch.nn.functional.linear(x, torch.ones(3, 8))
    assert torch.equal(y, bi.linear(x, torch.ones(3, 8)))
