"""A block's bytes out of and into the pool (worker/kv_blocks.py): read_blocks then write_blocks is the
identity, whether the pool tensors' slices line up with their dtypes in the flat payload (written
from views, no copy) or not (a tensor of 3 bytes per block before one of float32: copied first)."""
from __future__ import annotations

import torch

from kvserve.kv.block_io import BlockAssembly, pack_block, unpack_block
from kvserve.worker.kv_blocks import read_blocks, write_blocks


class Pools:
    def __init__(self, tensors):
        self.tensors = tensors


def test_round_trip_aligned_and_not():
    g = torch.Generator().manual_seed(0)
    for shapes in ([(torch.float32, (4, 2, 3)), (torch.bfloat16, (4, 2, 3))],       # aligned
                   [(torch.uint8, (4, 3)), (torch.float32, (4, 2)), (torch.float16, (4, 1))]):   # not
        src = Pools([torch.randn(s, generator=g).to(dt) if dt != torch.uint8 else
                     torch.randint(0, 255, s, generator=g, dtype=dt) for dt, s in shapes])
        dst = Pools([torch.zeros_like(t) for t in src.tensors])
        data = read_blocks(src.tensors, [2, 0])
        write_blocks(dst.tensors, [1, 3], bytearray(data.tobytes()))
        for a, b in zip(src.tensors, dst.tensors):
            assert torch.equal(b[1], a[2]) and torch.equal(b[3], a[0]) and not b[0].any() and not b[2].any()


def test_assembly_equals_pack_block():
    key, parts = bytes(range(32)), [b"abc", b"defgh", b"ij"]
    a = BlockAssembly(key, 10)
    for p in parts:
        a.add(p)
    assert a.full and a.received == 10
    assert bytes(a.payload()) == pack_block(key, b"".join(parts))
    assert bytes(unpack_block(key, a.payload(), 10, verified=True)) == b"abcdefghij"
