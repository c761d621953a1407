"""Shapes kvserve's ops cannot take raise a clear error, never read past a tensor (issue 24, Bad
input: "never wrong results"). The inputs below are views into bigger storage, so that the
reads an unchecked op would make past them stay inside memory the test owns."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.isa import needs_kernels

pytestmark = needs_kernels
NB, KV, BS, D, H = 8, 2, 4, 16, 4


def caches(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(NB, KV, BS, D, generator=g).to(dtype) for _ in range(2)]


def test_decode_attention_refuses_heads_and_dims_it_does_not_hold():
    k, v = caches()
    tables, lens = torch.tensor([[1, 2]]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="query heads per KV head"):
        torch.ops.kvserve.decode_attention(torch.randn(1, 17 * KV, D), k, v, None, None, tables, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="caches are"):
        torch.ops.kvserve.decode_attention(torch.randn(1, H, D + 1), k, v, None, None, tables, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="int8 caches need float32 scales"):
        torch.ops.kvserve.decode_attention(torch.randn(1, H, D), *caches(torch.int8), None, None, tables, lens, 0.25, 0)
    with pytest.raises(RuntimeError, match="int4 takes"):
        torch.ops.kvserve.linear_int4(torch.randn(1, 64), torch.zeros(16, 32, dtype=torch.uint8),
                                      torch.zeros(16, 2, 1, dtype=torch.bfloat16), 48)
    with pytest.raises(RuntimeError, match="int4 takes"):      # scales in torch's [K/G, N, 2] order
        torch.ops.kvserve.linear_int4(torch.randn(1, 64), torch.zeros(16, 32, dtype=torch.uint8),
                                      torch.zeros(2, 16, 2, dtype=torch.bfloat16), 32)
    for high in (torch.zeros(16, 4, dtype=torch.uint8), torch.zeros(16, 16, dtype=torch.uint8),
                 torch.zeros(16, 8, dtype=torch.int8)):       # int5's fifth bits: [N, K/8] uint8 only
        with pytest.raises(RuntimeError, match="fifth bits are"):
            torch.ops.kvserve.linear_int4(torch.randn(1, 64), torch.zeros(16, 32, dtype=torch.uint8),
                                          torch.zeros(16, 2, 2, dtype=torch.bfloat16), 32, high)
    with pytest.raises(RuntimeError, match="Q8_0 takes"):     # d float32: the float16 the file holds only
        torch.ops.kvserve.linear_q8_0(torch.randn(1, 64), torch.zeros(16, 64, dtype=torch.int8), torch.zeros(16, 2))
    for cols in (8, 1, 3, 0):                                # blocks of 8, 64, K / 3; no d at all: 32 or 16 only
        with pytest.raises(RuntimeError, match="Q8_0 takes"):
            torch.ops.kvserve.linear_q8_0(torch.randn(1, 64), torch.zeros(16, 64, dtype=torch.int8),
                                          torch.zeros(16, cols, dtype=torch.float16))


def test_decode_attention_refuses_int8_scales_of_the_wrong_shape():
    kq, vq = caches(torch.int8)
    storage = torch.rand(NB * KV * BS) * 1e30              # what lies past the too-small view
    scales = storage[:NB * KV].view(NB, KV)                 # [num_blocks, KV]: the block_size axis missing
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.kvserve.decode_attention(torch.randn(1, H, D), kq, vq, scales, scales, torch.tensor([[1, 2]]),
                                           torch.tensor([5]), 0.25, 0)


def test_decode_attention_refuses_a_context_longer_than_its_block_table():
    k, v = caches()
    storage = torch.tensor([[1, 2, 3, 0]])
    tables = storage[:, :3]                                 # [1, 3] holds 12 tokens; storage[0, 3] lies past it
    assert tables.is_contiguous()
    with pytest.raises(RuntimeError, match="context"):
        torch.ops.kvserve.decode_attention(torch.randn(1, H, D), k, v, None, None, tables,
                                           torch.tensor([3 * BS + 1]), 0.25, 0)


def test_decode_attention_refuses_block_ids_outside_the_cache():
    k, v = caches()
    with pytest.raises(RuntimeError, match="block id"):
        torch.ops.kvserve.decode_attention(torch.randn(1, H, D), k, v, None, None, torch.tensor([[1, NB]]),
                                           torch.tensor([BS + 1]), 0.25, 0)


def test_decode_layers_refuses_a_slot_outside_the_cache():
    """The fused step writes each new token's K/V at its slot: one past the cache is refused."""
    k, v = caches()
    hidden, I = H * D, 32
    norm = torch.ones(hidden)
    empty = torch.empty(0)
    weights = [norm, norm, empty, empty, empty,
               torch.randn((H + 2 * KV) * D, hidden), empty, empty,
               torch.randn(hidden, H * D), empty, empty,
               torch.randn(2 * I, hidden), empty, empty,
               torch.randn(hidden, I), empty, empty]
    cos, sin = torch.ones(64, D), torch.zeros(64, D)
    with pytest.raises(RuntimeError, match="slot"):
        torch.ops.kvserve.decode_layers(torch.randn(1, hidden), weights, [0, 0] * 4, cos, sin, torch.tensor([4]),
                                        [k], [v], [], [], torch.tensor([[1, 2]]), torch.tensor([5]),
                                        torch.tensor([NB * BS]), H, KV, 1e-5, 0.25, 0)


def test_ops_have_shape_functions_for_tracing():
    """torch.compile / FakeTensorMode trace the ops through their registered fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 64)
        y = torch.ops.kvserve.linear_int4(x, torch.empty(48, 32, dtype=torch.uint8),
                                          torch.empty(48, 2, 2, dtype=torch.bfloat16), 32)
        att = torch.ops.kvserve.decode_attention(torch.empty(2, H, D), *caches(), None, None,
                                                 torch.empty(2, 2, dtype=torch.long),
                                                 torch.empty(2, dtype=torch.long), 0.25, 0)
        act = torch.ops.kvserve.silu_mul(torch.empty(3, 64))
    assert y.shape == (3, 48) and att.shape == (2, H, D) and act.shape == (3, 32)
