"""kvserve's paged decode attention (torch.ops.kvserve.decode_attention) against the pure-torch
decode (TorchPagedAttention's, on the same metadata: block tables, context lengths and the key
mask of build_decode_key_mask), on every ISA allowed here, property-based over head dims (8 to
128, and 36 / 40, which are not a multiple of the widest vector and fall back to a narrower ISA),
GQA ratios 1-8, block sizes 1-32, context lengths 1-4096, sliding windows, float32 / bfloat16 /
int8 caches (int8: dequantized, then the float reference) and block tables in random order,
padded with NULL_BLOCK.

Every cache slot no sequence may read (the null block, the tail of a last block, spare blocks)
holds 1e4: a kernel that reads one is off by far more than the tolerance. Tolerance: 2e-5 of
the largest |V| (the output is a convex combination of V rows; measured up to 2.4e-6 over 600
random cases on the three ISAs).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.attention import kv_quant
from kvserve.attention.metadata import AttentionMetadata, build_decode_key_mask
from kvserve.attention.torch_paged import TorchPagedAttention
from tests.kernels.isa import ISA_BITS, needs_kernels, on_isa
from tests.kernels.test_linear_ops import threads

pytestmark = needs_kernels
POISON = 1e4
TOL = 2e-5


def reference(q, k, v, tables, lens, window, H, KV, D, bs):
    """The pure-torch decode on float32 caches (the backend's own, not kvserve's kernel)."""
    attn = TorchPagedAttention(H, KV, D, bs, window)
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), num_decode_tokens=len(lens),
                             decode_block_tables=tables, decode_context_lens=lens,
                             decode_key_mask=build_decode_key_mask(lens, tables.shape[1] * bs, window))
    decode = getattr(attn, "_decode_torch", attn._decode)   # the torch path, not the kernel it may call
    return decode(q, k, v, meta)


def run_case(seed, D, KV, G, bs, lens, window, kv, pad, q_scale, bits, n_threads):
    g = torch.Generator().manual_seed(seed)
    B, H = len(lens), KV * G
    need = [-(-n // bs) for n in lens]
    num_blocks = 1 + sum(need) + 2                                  # the null block, two spare ones
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()   # never NULL_BLOCK
    tables = torch.full((B, max(need) + pad), NULL_BLOCK, dtype=torch.long)
    valid = torch.zeros(num_blocks, bs, dtype=torch.bool)            # slots some sequence reads
    for b, n in enumerate(need):
        ids = [order.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(ids)
        for t in range(lens[b]):
            valid[ids[t // bs], t % bs] = True
    poison = ~valid[:, None, :, None]                                # [num_blocks, 1, bs, 1]
    shape = (num_blocks, KV, bs, D)
    if kv == "int8":
        caches = []
        for _ in range(2):
            values = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
            scales = torch.rand(shape[:-1], generator=g) * 0.02 + 1e-3   # [num_blocks, KV, bs]
            scales.masked_fill_(poison[..., 0], POISON)
            caches.append((values, scales))
        (kq, ks), (vq, vs) = caches
        kf, vf = kv_quant.dequantize(kq, ks, torch.float32), kv_quant.dequantize(vq, vs, torch.float32)
    else:
        dtype = torch.float32 if kv == "float32" else torch.bfloat16
        kq, vq = (torch.randn(shape, generator=g).masked_fill(poison, POISON).to(dtype) for _ in range(2))
        ks = vs = None
        kf, vf = kq.float(), vq.float()
    q = torch.randn(B, H, D, generator=g) * q_scale
    lens_t = torch.tensor(lens)
    with on_isa(bits), threads(n_threads):
        out = torch.ops.kvserve.decode_attention(q, kq, vq, ks, vs, tables, lens_t, D ** -0.5, window or 0)
    ref = reference(q, kf, vf, tables, lens_t, window, H, KV, D, bs)
    vmax = vf.masked_fill(poison, 0.0).abs().max()
    err = (out - ref).abs().max()
    assert out.shape == (B, H, D) and err <= TOL * vmax, f"max error {err:.3g} against max |v| {vmax:.3g}"


CASE = dict(seed=st.integers(0, 2**31), D=st.sampled_from([8, 36, 40, 64, 128]), KV=st.integers(1, 4),
            G=st.integers(1, 8), bs=st.integers(1, 32), window=st.one_of(st.none(), st.integers(1, 80)),
            kv=st.sampled_from(["float32", "bfloat16", "int8"]), pad=st.integers(0, 2),
            q_scale=st.sampled_from([1.0, 4.0]), n_threads=st.sampled_from([1, 2]))


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), **CASE)
def test_decode_attention_short_contexts(bits, lens, **case):
    run_case(bits=bits, lens=lens, **case)


@pytest.mark.parametrize("bits", ISA_BITS)
@settings(max_examples=4, deadline=None)
@given(lens=st.lists(st.integers(256, 4096), min_size=1, max_size=2),
       **{**CASE, "bs": st.integers(8, 32), "window": st.one_of(st.none(), st.integers(1, 3000))})
def test_decode_attention_long_contexts_split_along_the_tokens(bits, lens, **case):
    """Few (sequence, KV head) items over >= 256 tokens: FlashDecoding's split, then the merge."""
    run_case(bits=bits, lens=lens, **case)


@pytest.mark.parametrize("bits", ISA_BITS)
def test_one_long_sequence_of_block_size_one(bits):
    run_case(seed=7, D=64, KV=1, G=8, bs=1, lens=[4096], window=None, kv="bfloat16", pad=1, q_scale=4.0,
             bits=bits, n_threads=2)


@pytest.mark.parametrize("bits", ISA_BITS)
@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("G", [1, 2, 3, 4])
def test_the_register_route_head_dim_64(bits, kv, G):
    """Head dim 64 with up to 4 query heads per KV head over a float32 or bfloat16 cache takes the
    register-resident loop (attention.h `attn_part_regs`): block sizes that do and do not divide
    the 32-token chunks, windows, contexts across several chunks, FlashDecoding's splits."""
    for seed, (bs, lens, window) in enumerate([(16, [1, 33, 200], None), (7, [64, 65], 40), (1, [95], None),
                                               (32, [300, 17], 100), (16, [1500], None), (5, [700], 333)]):
        run_case(seed, 64, 2, G, bs, lens, window, kv, pad=1, q_scale=4.0, bits=bits, n_threads=2)
