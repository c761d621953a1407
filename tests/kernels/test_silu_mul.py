"""kvserve's SwiGLU (torch.ops.kvserve.silu_mul; float32 and bfloat16 rows), bfloat16 RMSNorm
(rms_norm_bf16, and add_rms_norm after a residual add, bfloat16 or float32) and bfloat16 / float32 RoPE (rope) against float64 / torch references, on every
ISA allowed here: rows 1-8, widths across the kernel's 256-wide chunks, gates far into both
tails of exp. Tolerance: 1e-5 relative plus 1e-30 (measured a few float32 ulp)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.layers import add_rms_norm, apply_rope, rope_cos_sin, rope_inv_freq, swiglu
from tests.kernels.isa import ISA_BITS, needs_kernels, on_isa

pytestmark = needs_kernels


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 8), inter=st.integers(1, 700),
       spread=st.sampled_from([1.0, 10.0, 200.0]))
def test_silu_mul(bits, seed, T, inter, spread):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(T, 2 * inter, generator=g) * spread              # [T, 2I]: gate, then up
    with on_isa(bits):
        out = torch.ops.kvserve.silu_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert out.shape == (T, inter)
    assert bool(((out.double() - ref).abs() <= 1e-5 * ref.abs() + 1e-30).all())


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), inter=st.integers(1, 700))
def test_silu_mul_of_bfloat16_rows(bits, seed, T, inter):
    """bfloat16 rows (a bfloat16 model's prefill): silu(gate) rounded to bfloat16, times up,
    rounded again, as torch's F.silu(gate) * up on bfloat16: equal to torch's but where the two
    exps' last bits put silu(gate) across a rounding boundary (one bfloat16 step, rarely)."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(T, 2 * inter, generator=g) * 4).bfloat16()
    with on_isa(bits):
        out = torch.ops.kvserve.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (F.silu(gate) * up).float()
    diff = (out.float() - ref).abs()
    assert out.dtype == torch.bfloat16 and out.shape == (T, inter)
    assert bool((diff <= 2 ** -6 * ref.abs() + 1e-30).all())
    assert (diff > 0).float().mean() <= 0.01


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(0, 20), inter=st.integers(1, 700))
def test_silu_mul_of_bfloat16_rows_into_float32(bits, seed, T, inter):
    """bfloat16 rows into float32 (a float32 model's big steps, their GEMM in bfloat16): bit for bit
    the float32 SwiGLU of the rows converted first; into bfloat16 with out_dtype named, that float32
    result rounded once (what the next bfloat16 GEMM took of it), through layers.swiglu too;
    without out_dtype, torch's two bfloat16 roundings (test_silu_mul_of_bfloat16_rows); other
    dtype pairs refused."""
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(T, 2 * inter, generator=g) * 4).bfloat16()
    with on_isa(bits):
        out = torch.ops.kvserve.silu_mul(gate_up, torch.float32)
        assert out.dtype == torch.float32 and torch.equal(out, torch.ops.kvserve.silu_mul(gate_up.float()))
        once = torch.ops.kvserve.silu_mul(gate_up, torch.bfloat16)
        assert once.dtype == torch.bfloat16 and torch.equal(once, out.bfloat16())
        assert torch.equal(swiglu(gate_up, torch.float32, torch.bfloat16), once)
        assert torch.equal(swiglu(gate_up, torch.float32), out)
    with pytest.raises(RuntimeError, match="float32 from bfloat16"):
        torch.ops.kvserve.silu_mul(gate_up.float(), torch.bfloat16)


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), H=st.integers(1, 700), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_rms_norm_of_bfloat16_rows(bits, seed, T, H, scale):
    """layers.rms_norm's bfloat16 formula (normalise in float32, round, times the weight, round):
    the op gives the same bfloat16 values but where float32 rounding of the sum of squares
    moves a value across a bfloat16 rounding boundary (a step or two after the weight, rarely)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * scale).bfloat16()
    w = (torch.rand(H, generator=g) + 0.5).bfloat16()
    with on_isa(bits):
        out = torch.ops.kvserve.rms_norm_bf16(x, w, 1e-5)
    ref = w * F.rms_norm(x.float(), (H,), None, 1e-5).to(torch.bfloat16)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= 2 ** -6 * ref.float().abs() + 1e-30).all())
    assert (diff > 0).float().mean() <= 0.01


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), H=st.integers(1, 700), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_residual_add_and_norm_in_one_pass(bits, seed, T, H, scale):
    """add_rms_norm(x, d, w) on bfloat16 rows: the sum bit for bit torch's bfloat16 x + d, and its norm bit for
    bit rms_norm_bf16 of that sum (the same kernel reads it): the layer-by-layer path's numbers do
    not move when the add and the next norm fuse."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * scale).bfloat16()
    d = (torch.randn(T, H, generator=g) * scale).bfloat16()
    w = (torch.rand(H, generator=g) + 0.5).bfloat16()
    with on_isa(bits):
        s, h = torch.ops.kvserve.add_rms_norm(x, d, w, 1e-5)
        ref_h = torch.ops.kvserve.rms_norm_bf16(x + d, w, 1e-5)
        via_layers = add_rms_norm(x.view(T, 1, H), d.view(T, 1, H), w, 1e-5)
    assert torch.equal(s, x + d) and torch.equal(h, ref_h)
    assert via_layers[0].shape == (T, 1, H) and torch.equal(via_layers[0].view(T, H), s)
    assert torch.equal(via_layers[1].view(T, H), h)


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), H=st.integers(1, 700), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_residual_add_and_norm_of_float32_rows(bits, seed, T, H, scale):
    """add_rms_norm(x, d, w) on float32 rows (a float32 model's prefill): the sum bit for bit torch's
    x + d; its norm bit for bit the fused decode step's (the sum of squares one float32 chain of
    adds a row, here in numpy), so a row's norm is the same number on both paths, and within
    1e-5 of F.rms_norm; a weight of another dtype refused."""
    g = torch.Generator().manual_seed(seed)
    x, d = torch.randn(T, H, generator=g) * scale, torch.randn(T, H, generator=g) * scale
    w = torch.rand(H, generator=g) + 0.5
    with on_isa(bits):
        s, h = torch.ops.kvserve.add_rms_norm(x, d, w, 1e-5)
        via_layers = add_rms_norm(x.view(T, 1, H), d.view(T, 1, H), w, 1e-5)
    assert torch.equal(s, x + d)
    sn, ss = s.numpy(), np.zeros(T, dtype=np.float32)
    for i in range(H):
        ss += sn[:, i] * sn[:, i]
    k = np.float32(1) / np.sqrt(ss / np.float32(H) + np.float32(1e-5))
    assert torch.equal(h, torch.from_numpy(sn * k[:, None] * w.numpy()))
    assert torch.allclose(h, F.rms_norm(x + d, (H,), w, 1e-5), rtol=1e-5, atol=1e-30)
    assert torch.equal(via_layers[0].view(T, H), s) and torch.equal(via_layers[1].view(T, H), h)
    with pytest.raises(RuntimeError, match="add_rms_norm takes"):
        torch.ops.kvserve.add_rms_norm(x, d, w.bfloat16(), 1e-5)


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 40), heads=st.integers(1, 12),
       D=st.sampled_from([2, 8, 64, 96, 128, 256]), extra=st.integers(0, 3),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_rope_of_bfloat16_and_float32_heads(bits, seed, T, heads, D, extra, dtype):
    """bfloat16 or float32 heads (a model's prefill), viewed in a wider fused-QKV row as the model
    passes them: bit for bit torch's addcmul(x * cos, roll(x, D/2), sin) in that dtype (bfloat16:
    both products are exact in float32, and both sides round the same sums the same way; float32:
    x * cos rounded, then a fused multiply-add, as torch's AVX2 / AVX-512 addcmul; torch's DEFAULT
    build rounds the second product too, so there the two are within an ulp of the sum)."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (heads + extra) * D, generator=g) * 3).to(dtype)
    x = qkv[:, :heads * D].view(T, heads, D)                            # rows (heads + extra) * D apart
    cos, sin = rope_cos_sin(rope_inv_freq(D, 10000.0, None), 4096)
    pos = torch.randint(0, 4096, (T,), generator=g)
    c, s = cos[pos].to(dtype).unsqueeze(1), sin[pos].to(dtype).unsqueeze(1)     # [T, 1, D]
    with on_isa(bits):
        out = torch.ops.kvserve.rope(x, c.view(T, D), s.view(T, D))
        via_layers = apply_rope(x, c, s)
    ref = torch.addcmul(x * c, x.roll(D // 2, dims=-1), s)
    assert out.shape == (T, heads, D) and torch.equal(via_layers, out)
    if dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        bound = 2 ** -23 * ((x * c).abs() + (x.roll(D // 2, dims=-1) * s).abs())
        assert bool(((out - ref).abs() <= bound).all())
    else:
        assert torch.equal(out, ref)


def test_bfloat16_row_ops_refuse_what_they_do_not_take():
    with pytest.raises(RuntimeError, match="rope takes"):
        torch.ops.kvserve.rope(torch.zeros(2, 3, 8, dtype=torch.bfloat16), torch.zeros(2, 7, dtype=torch.bfloat16),
                               torch.zeros(2, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="rope takes"):
        torch.ops.kvserve.rope(torch.zeros(2, 3, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="rope takes"):
        torch.ops.kvserve.rope(torch.zeros(2, 3, 8, dtype=torch.float16), torch.zeros(2, 8, dtype=torch.float16),
                               torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.kvserve.silu_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="rms_norm_bf16 takes"):
        torch.ops.kvserve.rms_norm_bf16(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(7, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm_bf16 takes"):
        torch.ops.kvserve.rms_norm_bf16(torch.zeros(2, 8), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm takes"):
        torch.ops.kvserve.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(3, 8, dtype=torch.bfloat16),
                                            torch.zeros(8, dtype=torch.bfloat16), 1e-5)
