"""TorchPagedAttention against a float64 reference: decodes and prefill chunks (fresh, cached,
ragged, windowed) in one ragged batch; every prefill chunk in one 4-D SDPA call; the prefill
layout built once per step, not once per layer."""
from __future__ import annotations

import pytest
import torch

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.attention import metadata, torch_paged
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk, build_decode_key_mask
from kvserve.attention.torch_paged import TorchPagedAttention

H, KV, D, BS = 4, 2, 8, 4


def make_step(seqs, window, num_blocks=64, seed=0):
    """seqs: (cached tokens, new tokens) per sequence, decodes (new == 1) first. Returns the
    backend, caches holding each sequence's cached K/V, the step's q/k/v, its metadata and the
    float64 reference output [T, H, D]."""
    g = torch.Generator().manual_seed(seed)
    attn = TorchPagedAttention(H, KV, D, BS, window)
    k_cache = torch.zeros(attn.cache_shape(num_blocks))
    v_cache = torch.zeros(attn.cache_shape(num_blocks))
    free = list(range(num_blocks - 1, NULL_BLOCK, -1))          # never the null block
    qs, ks, vs, slots, ref = [], [], [], [], []
    tables, decode_lens, prefills, offset = [], [], [], 0
    for cached, new in seqs:
        n = cached + new
        table = [free.pop() for _ in range(-(-n // BS))]
        q = torch.randn(n, H, D, generator=g)
        k, v = torch.randn(n, KV, D, generator=g), torch.randn(n, KV, D, generator=g)
        for p in range(cached):                                 # earlier steps' K/V
            k_cache[table[p // BS], :, p % BS] = k[p]
            v_cache[table[p // BS], :, p % BS] = v[p]
        for p in range(cached, n):
            slots.append(table[p // BS] * BS + p % BS)
            lo = 0 if window is None else max(0, p - window + 1)
            kk = k[lo:p + 1].double().repeat_interleave(H // KV, dim=1)        # [keys, H, D]
            vv = v[lo:p + 1].double().repeat_interleave(H // KV, dim=1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[p].double(), kk) * D ** -0.5, dim=-1)
            ref.append(torch.einsum("hk,khd->hd", w, vv))
        qs.append(q[cached:])
        ks.append(k[cached:])
        vs.append(v[cached:])
        if new == 1:
            tables.append(table)
            decode_lens.append(n)
        else:
            prefills.append(PrefillChunk(offset, new, n, torch.tensor(table)))
        offset += new
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=len(decode_lens),
                             prefills=prefills)
    if decode_lens:
        width = max(len(t) for t in tables)
        meta.decode_block_tables = torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables])
        meta.decode_context_lens = torch.tensor(decode_lens)
        meta.decode_key_mask = build_decode_key_mask(meta.decode_context_lens, width * BS, window)
    return attn, k_cache, v_cache, torch.cat(qs), torch.cat(ks), torch.cat(vs), meta, torch.stack(ref)


STEPS = {
    "one fresh prompt": [(0, 13)],
    "fresh, same length": [(0, 8), (0, 8), (0, 8)],
    "fresh, ragged": [(0, 3), (0, 11), (0, 6)],
    "cached context": [(5, 7), (0, 4), (17, 9)],
    "decodes and chunks": [(6, 1), (21, 1), (0, 5), (9, 8)],
}


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("name", list(STEPS))
def test_ragged_batch_equals_the_reference(name, window):
    attn, kc, vc, q, k, v, meta, ref = make_step(STEPS[name], window)
    out = attn.forward(q, k, v, kc, vc, meta)                          # [T, H, D]
    assert out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_all_prefill_chunks_run_in_one_4d_sdpa_call(monkeypatch):
    """One call per layer for every chunk, with 4-D inputs (torch's fused CPU flash kernel takes
    only those; the per-chunk loop ran one 3-D call per chunk)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        calls.append((q.dim(), k.dim()))
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", counting)
    for name in ("fresh, ragged", "cached context", "decodes and chunks"):
        calls.clear()
        attn, kc, vc, q, k, v, meta, ref = make_step(STEPS[name], None)
        attn.forward(q, k, v, kc, vc, meta)
        assert calls == [(4, 4)], name


def test_the_prefill_layout_is_built_once_per_step(monkeypatch):
    built = []
    real = metadata.build_prefill_layout
    monkeypatch.setattr(metadata, "build_prefill_layout", lambda *a: built.append(1) or real(*a))
    attn, kc, vc, q, k, v, meta, ref = make_step(STEPS["cached context"], 6)
    kc2, vc2 = kc.clone(), vc.clone()
    first = attn.forward(q, k, v, kc, vc, meta)                        # layer 0
    second = attn.forward(q, k, v, kc2, vc2, meta)                     # layer 1, same step
    assert len(built) == 1
    torch.testing.assert_close(first, second)


def test_padding_reads_only_the_null_block():
    """Decode tables and prefill contexts are padded with NULL_BLOCK; live blocks are never read
    past a sequence's own: poisoning every block no sequence owns except the (zero) null block
    changes nothing."""
    attn, kc, vc, q, k, v, meta, ref = make_step(STEPS["decodes and chunks"], None)
    owned = {int(b) for t in meta.decode_block_tables for b in t} | {
        int(b) for c in meta.prefills for b in c.block_table}
    for b in range(kc.shape[0]):
        if b not in owned and b != NULL_BLOCK:
            kc[b], vc[b] = float("nan"), float("nan")
    out = attn.forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert int((meta.decode_block_tables == NULL_BLOCK).sum()) > 0      # the step had padding
