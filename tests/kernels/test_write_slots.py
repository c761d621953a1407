"""kvserve's write_slots (the torch path's KV write on the CPU: new tokens' K or V rows into their
paged slots) against torch's `cache[block, :, offset] = rows`: the same pool afterwards, bit for
bit, for float32, bfloat16 and float16, rows strided as the fused QKV output leaves them; slots outside
the pool refused before anything is written."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.isa import needs_kernels

pytestmark = needs_kernels


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), T=st.integers(1, 70), KV=st.integers(1, 4), D=st.sampled_from([8, 64, 80]),
       bs=st.sampled_from([1, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), extra=st.integers(0, 2))
def test_rows_land_in_their_slots(seed, T, KV, D, bs, dtype, extra):
    g = torch.Generator().manual_seed(seed)
    blocks = (T + bs - 1) // bs + 3
    pool = torch.randn(blocks, KV, bs, D, generator=g).to(dtype)
    wide = torch.randn(T, KV + extra, D, generator=g).to(dtype)
    rows = wide[:, extra:]                                             # rows (KV + extra) * D apart
    slots = torch.randperm(blocks * bs, generator=g)[:T]
    ref = pool.clone()
    ref[slots // bs, :, slots % bs] = rows
    torch.ops.kvserve.write_slots(rows, pool, slots)
    assert torch.equal(pool, ref)


def test_slots_outside_the_pool_are_refused_and_nothing_is_written():
    pool = torch.zeros(2, 1, 4, 8)
    rows = torch.ones(3, 1, 8)
    for bad in ([0, 1, 8], [0, -1, 2]):
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.kvserve.write_slots(rows, pool, torch.tensor(bad))
        assert not pool.any()
    with pytest.raises(RuntimeError, match="write_slots takes"):
        torch.ops.kvserve.write_slots(rows.bfloat16(), pool, torch.tensor([0, 1, 2]))
