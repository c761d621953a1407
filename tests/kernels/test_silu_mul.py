"""kvserve's SwiGLU (torch.ops.kvserve.silu_mul) against F.silu(gate) * up in float64, on every
ISA allowed here: rows 1-8, widths across the kernel's 256-wide chunks, gates far into both
tails of exp. Tolerance: 1e-5 relative plus 1e-30 (measured a few float32 ulp)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

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
