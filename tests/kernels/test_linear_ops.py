"""kvserve's GEMV ops (torch.ops.kvserve.linear_int4 / linear_int8 / linear_q8_0 / linear_bf16) against float64
matmuls of the dequantized weights, on every ISA allowed here, property-based over shapes.

Tolerances, per output y[t, n], with M = |x| @ |W|.T (the sum of the absolute products):
  float routes (int4 without block scales or with > INT4_Q16_ROWS rows, int8, Q8_0 with more rows):  4e-6 * M
    (float32 accumulation over K <= 2304; measured up to 1.2e-6 * M, about 5e-7 of max |y|, on the
    portable code's one-accumulator sums)
  int4 with block scales, <= INT4_Q16_ROWS rows (activations in int16 per 32 weights):
    1.01 * (|(q - 8) * scale| @ amax32(x).T) / 65534 + 4e-6 * M: the activation rounding of at
    most half a step (amax of the 32-block / 32767) times the weights it multiplies (measured
    about 2e-5 of max |y|, 3e-6 * M). Where block scales are given but the route falls back (more
    rows, K not a multiple of 64) the result is the float route's, bit for bit.
  AMX (csrc/isa_amx.cpp, CPUs with AMX-BF16, steps of at least amx_rows() rows, every format): 4e-6 * M
    against the product of x and W each rounded to bfloat16 (products exact in float32, summed in float32).
  Q8_0, <= KERNEL_ROWS rows (activations in int16 per 32 weights): 4e-6 * M against the product of
    x's int16 blocks (the integer sums are exact), and 1.01 * (|W| @ amax32(x).T) / 65534 + 4e-6 * M
    against x itself.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvserve import kernels
from kvserve.model.quant.formats import Int4Weight, Int8Weight, quantize_int8
from tests.kernels.isa import ISA_BITS, needs_kernels, on_isa

pytestmark = needs_kernels
FLOAT_TOL = 4e-6
SETTINGS = settings(max_examples=25, deadline=None)


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def activations(g: torch.Generator, T: int, K: int) -> torch.Tensor:
    """x [T, K] float32: 32-blocks of very different magnitudes, one of them all zero."""
    x = torch.randn(T, K, generator=g) * torch.exp(2 * torch.randn(T, K // 32, 1, generator=g)).repeat_interleave(
        32, dim=1).view(T, K)
    zero = int(torch.randint(0, K // 32, (1,), generator=g))
    x[:, 32 * zero:32 * zero + 32] = 0.0
    return x


def int4_weight(g: torch.Generator, N: int, K: int, group: int, zeros: bool, fifth: bool = False) -> Int4Weight:
    """`fifth`: int5 (q in 0..31, a GGUF Q5 type's; K a multiple of 32)."""
    q = torch.randint(0, 32 if fifth else 16, (N, K), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // group, generator=g) * 0.1 + 1e-3
    zero = torch.randn(N, K // group, generator=g) * 0.05 if zeros else None
    return Int4Weight(q, scale, zero, dtype=torch.float32)


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, extra: torch.Tensor | float = 0.0):
    """y [T, N] against x @ w.T in float64, within FLOAT_TOL * M + extra."""
    ref = x.double() @ w.double().T
    bound = FLOAT_TOL * (x.double().abs() @ w.double().abs().T) + extra + 1e-30
    err = (y.double() - ref).abs()
    assert y.shape == ref.shape and bool((err <= bound).all()), (
        f"max error {err.max():.3g} (relative {err.max() / ref.abs().max():.3g}), "
        f"worst over bound {(err / bound).max():.3g}")


def q16_rounding(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """(|(q - 8) * scale| @ amax32(x).T) / 65534 [T, N]: the int16 route's activation rounding."""
    N, K = w.shape
    T = x.shape[0]
    amax = x.double().abs().view(T, K // 32, 32).amax(-1).repeat_interleave(32, dim=1)          # [T, K]
    scale = w.scales[:, 0].double().repeat_interleave(w.group_size, dim=1)                      # [N, K]
    q = w.q_values().double()
    return 1.01 * (amax @ ((q - 8).abs() * scale).T) / 65534


@pytest.mark.parametrize("bits", ISA_BITS)
@SETTINGS
@given(seed=st.integers(0, 2**31), group=st.sampled_from([32, 64, 128, 256]), blocks=st.integers(1, 9),
       N=st.integers(1, 80), T=st.integers(1, 40), few=st.booleans(), zeros=st.booleans(),
       n_threads=st.sampled_from([1, 2]), fifth=st.booleans())
@example(seed=1, group=256, blocks=9, N=33, T=5, few=False, zeros=True, n_threads=1, fifth=False)   # two 1024 slabs
@example(seed=2, group=32, blocks=3, N=20, T=2, few=True, zeros=True, n_threads=1, fifth=False)     # K % 64: float
@example(seed=3, group=128, blocks=2, N=17, T=3, few=True, zeros=False, n_threads=2, fifth=False)
@example(seed=4, group=32, blocks=40, N=35, T=40, few=False, zeros=True, n_threads=2, fifth=False)  # 1,280 wide: slabs
@example(seed=9, group=64, blocks=9, N=20, T=150, few=False, zeros=True, n_threads=2, fifth=False)  # AMX: 150 rows, 576 wide
@example(seed=10, group=256, blocks=9, N=17, T=130, few=False, zeros=False, n_threads=1, fifth=False)  # AMX: 2,304 wide
@example(seed=11, group=32, blocks=18, N=20, T=2, few=True, zeros=True, n_threads=1, fifth=True)    # int5: int16 route, 3 rows
@example(seed=16, group=32, blocks=18, N=22, T=0, few=True, zeros=True, n_threads=1, fifth=True)    # int5: int16 route, 1 row, K % 128
@example(seed=17, group=64, blocks=12, N=23, T=1, few=True, zeros=False, n_threads=2, fifth=False)  # int16 route, 2 rows
@example(seed=18, group=32, blocks=18, N=21, T=3, few=True, zeros=True, n_threads=2, fifth=True)    # int5: int16 route, 4 rows
@example(seed=19, group=128, blocks=6, N=19, T=4, few=True, zeros=True, n_threads=1, fifth=False)   # int16 route, 5 rows
@example(seed=20, group=32, blocks=18, N=18, T=7, few=True, zeros=True, n_threads=2, fifth=True)    # int16 route (not AMX), 8 rows
@example(seed=12, group=32, blocks=3, N=20, T=2, few=True, zeros=True, n_threads=1, fifth=True)     # int5: K % 64, float
@example(seed=13, group=32, blocks=40, N=35, T=40, few=False, zeros=True, n_threads=2, fifth=True)  # int5: tiles
@example(seed=14, group=64, blocks=9, N=20, T=150, few=False, zeros=True, n_threads=2, fifth=True)  # int5: AMX
@example(seed=15, group=256, blocks=9, N=37, T=250, few=False, zeros=True, n_threads=2, fifth=False)  # AMX: two blocks of x
def test_linear_int4(bits, seed, group, blocks, N, T, few, zeros, n_threads, fifth):
    """Every route (int16 for <= INT4_Q16_ROWS rows, float blocks to 8 rows, float tiles past
    that) against the float64 product of the dequantized weight; int4 and int5 (a fifth bit)."""
    g = torch.Generator().manual_seed(seed)
    K = group * blocks
    if few:
        T = 1 + T % 8                                         # the int16 route's and the blocks' rows
    w = int4_weight(g, N, K, group, zeros, fifth)
    assert (w.high is not None) == fifth
    x = activations(g, T, K)
    with on_isa(bits), threads(n_threads):
        y = torch.ops.kvserve.linear_int4(x, w.nibbles, w.scales, group, w.high)
        amx = on_amx(T)
    int16_route = T <= kernels.INT4_Q16_ROWS and K % 64 == 0
    if amx:
        check(y, *bf16_operands(x, w.dequantize(dtype=torch.float32)))
    else:
        check(y, x, w.dequantize(dtype=torch.float32), q16_rounding(x, w) if int16_route else 0.0)


@pytest.mark.parametrize("bits", ISA_BITS)
@SETTINGS
@given(seed=st.integers(0, 2**31), blocks=st.integers(1, 48), N=st.integers(1, 80), T=st.integers(1, 40),
       n_threads=st.sampled_from([1, 2]))
def test_linear_int8(bits, seed, blocks, N, T, n_threads):
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    q, scale = quantize_int8(torch.randn(N, K, generator=g), torch.bfloat16)    # q [N, K] int8, scale [N] bf16
    x = activations(g, T, K)
    with on_isa(bits), threads(n_threads):
        y = torch.ops.kvserve.linear_int8(x, q, scale)
        amx = on_amx(T)
    w = q.double() * scale.double()[:, None]
    check(y, *(bf16_operands(x, w) if amx else (x, w)))


@pytest.mark.parametrize("bits", ISA_BITS)
@SETTINGS
@given(seed=st.integers(0, 2**31), blocks=st.integers(1, 48), N=st.integers(1, 80), T=st.integers(1, 40),
       n_threads=st.sampled_from([1, 2]), block=st.sampled_from([32, 16]))
@example(seed=5, blocks=17, N=37, T=1, n_threads=2, block=32)      # odd blocks: the last one alone (AVX-512: masked)
@example(seed=6, blocks=18, N=9, T=3, n_threads=1, block=32)
@example(seed=7, blocks=1, N=5, T=2, n_threads=1, block=32)
@example(seed=959233579, blocks=2, N=75, T=1, n_threads=1, block=32)   # a product within an ulp of a half
@example(seed=16, blocks=48, N=37, T=340, n_threads=2, block=32)   # AMX: two blocks of x, a partial weight pair
@example(seed=18, blocks=3, N=11, T=1, n_threads=1, block=16)    # Q6_K's blocks of 16: the int16 route
@example(seed=21, blocks=17, N=37, T=3, n_threads=2, block=16)   # three rows, an odd last block
@example(seed=22, blocks=40, N=9, T=2, n_threads=1, block=16)    # two windows of 8 blocks and a part
@example(seed=19, blocks=5, N=13, T=6, n_threads=2, block=16)    # the tile path (AMX where present)
@example(seed=20, blocks=48, N=37, T=340, n_threads=2, block=16)
def test_linear_q8_0(bits, seed, blocks, N, T, n_threads, block):
    """GGUF Q8_0 (a float16 d per 32 weights) and the same format with d per 16 (Q6_K)."""
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    d = (torch.rand(N, K // block, generator=g) * 0.01).half()               # [N, K/B] float16 (GGUF's d)
    if N > 2:
        d[0, 0], d[1, -1] = 3e-7, 6e-5                                       # float16 subnormals: exact too
    x = activations(g, T, K)
    with on_isa(bits), threads(n_threads):
        y = torch.ops.kvserve.linear_q8_0(x, q, d)
        amx = on_amx(T)
    w = q.double() * d.double().repeat_interleave(block, dim=1)
    if amx:
        check(y, *bf16_operands(x, w))
    elif T <= kernels.KERNEL_ROWS:            # the int16 route: exactly x's int16 blocks times W, summed in float32
        check(y, q16_activations(x), w)
        check(y, x, w, 1.01 * (amax32(x) @ w.abs().T) / 65534)
    else:
        check(y, x, w)


@pytest.mark.parametrize("bits", ISA_BITS)
@SETTINGS
@given(seed=st.integers(0, 2**31), blocks=st.integers(1, 48), N=st.integers(1, 80), T=st.integers(1, 70),
       n_threads=st.sampled_from([1, 2]))
@example(seed=8, blocks=40, N=35, T=1, n_threads=2)      # 1,280 columns: two slabs; a partial last tile
@example(seed=17, blocks=48, N=37, T=350, n_threads=2)   # AMX: two blocks of x (320 + 30 rows), a partial pair
def test_linear_bf16(bits, seed, blocks, N, T, n_threads):
    """A bfloat16 weight: on AMX tiles at every row count where the CPU has them (x rounded to
    bfloat16, float32 sums), else torch's bfloat16 GEMM (its output rounded to bfloat16 too)."""
    g = torch.Generator().manual_seed(seed)
    K = 32 * blocks
    w = torch.randn(N, K, generator=g).bfloat16()
    x = activations(g, T, K)
    with on_isa(bits), threads(n_threads):
        y = torch.ops.kvserve.linear_bf16(x, w)
        amx = torch.ops.kvserve.amx_rows() > 0           # a dense weight takes AMX at any row count
    if amx:
        check(y, x.bfloat16(), w)
    else:
        check(y, x.bfloat16(), w, (x.bfloat16().double() @ w.double().T).abs() * 2 ** -8)


def on_amx(T: int) -> bool:
    """Whether a step of T rows runs on AMX tiles on the ISA now set (csrc/isa_amx.cpp)."""
    rows = torch.ops.kvserve.amx_rows()
    return 0 < rows <= T


def bf16_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and W as the AMX route multiplies them: each rounded once to bfloat16 (x from float32, W
    from its exact value rounded to float32), products summed in float32."""
    return x.bfloat16(), w.float().bfloat16()


def amax32(x: torch.Tensor) -> torch.Tensor:
    """max |x| of each 32-block, repeated over the block [T, K] (float64)."""
    T, K = x.shape
    return x.double().abs().view(T, K // 32, 32).amax(-1).repeat_interleave(32, dim=1)


def q16_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the Q8_0 int16 route sees it: per 32, round(x / dx) * dx with dx = max |x| / 32767."""
    T, K = x.shape
    xb = x.view(T, K // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # 32767 / amax rounded once, as the kernel divides (torch's `32767 / amax` multiplies by a
    # reciprocal: an ulp off, and a product within it of a half rounded the other way)
    inv = torch.where(amax > 0, (32767 / amax.double()).float(), torch.zeros_like(amax))
    return (torch.round(xb * inv).double() * (amax / 32767).double()).view(T, K)


@pytest.mark.parametrize("bits", ISA_BITS)
@SETTINGS
@given(seed=st.integers(0, 2**31), group=st.sampled_from([32, 64, 128]), blocks=st.integers(1, 6),
       N=st.integers(1, 40), zeros=st.booleans(), fifth=st.booleans())
def test_dequantize_ops_round_each_exact_value_once(bits, seed, group, blocks, N, zeros, fifth):
    """`dequantize_int4` / `dequantize_q8_0`: every weight's exact value ((q - 8) * scale + zero,
    q * d; q 0..31 with a fifth bit), rounded once to float32, and to bfloat16 from there (the
    dequantize path of big steps)."""
    g = torch.Generator().manual_seed(seed)
    K = group * blocks
    w = int4_weight(g, N, K, group, zeros, fifth)
    q = torch.stack([w.nibbles & 15, w.nibbles >> 4], -1).view(N, K).double()
    if fifth:
        q += 16 * ((w.high[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).view(N, K // 32, 2, 16).transpose(
            2, 3).reshape(N, K).double()
    scale, zero = (t.double().repeat_interleave(group, dim=1) for t in w.scales.unbind(1))     # [N, K]
    exact = (q - 8) * scale + zero
    q8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    with on_isa(bits):
        for dtype in (torch.float32, torch.bfloat16):
            got = torch.ops.kvserve.dequantize_int4(w.nibbles, w.scales, group, dtype, w.high)
            assert torch.equal(got, exact.float().to(dtype))
            for block in (32, 16):            # Q8_0; Q6_K's sub-blocks
                d = (torch.rand(N, K // block, generator=g) * 0.01).half()
                d[0, 0] = 3e-7                                               # a float16 subnormal
                exact8 = q8.double() * d.double().repeat_interleave(block, dim=1)
                assert torch.equal(torch.ops.kvserve.dequantize_q8_0(q8, d, dtype), exact8.float().to(dtype))


def test_quantized_weights_run_kvserves_ops():
    """Int4Weight.linear is kvserve's op, bit for bit, at every row count its plan gives the
    kernel (no packed copy of torch's is made beside it); Int8Weight's at <= KERNEL_ROWS rows;
    more rows take the other paths, still the same product."""
    g = torch.Generator().manual_seed(0)
    w4 = int4_weight(g, 64, 256, 64, zeros=True)
    w8 = Int8Weight(*quantize_int8(torch.randn(64, 256, generator=g), torch.bfloat16))
    if w4.kernel_max_rows < kernels.KERNEL_ROWS:
        pytest.skip(f"torch's capability {torch.backends.cpu.get_cpu_capability()} keeps int4 off the kernels")
    assert w4.packed is None and w4.tensors() == [w4.nibbles, w4.scales]
    for T in list(range(1, 9)) + [16, min(w4.kernel_max_rows, 40)]:
        x = torch.randn(T, 256, generator=g)
        assert torch.equal(w4.linear(x), torch.ops.kvserve.linear_int4(x, w4.nibbles, w4.scales, 64))
        if T <= kernels.KERNEL_ROWS:
            assert torch.equal(w8.linear(x), torch.ops.kvserve.linear_int8(x, w8.q, w8.scale))
    x = torch.randn(8, 256, generator=g)
    torch.testing.assert_close(w4.linear(x), x @ w4.dequantize(dtype=torch.float32).T, rtol=2e-2, atol=2e-2)
