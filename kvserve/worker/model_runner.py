"""The model runner: packs one step's scheduled tokens into one flat (ragged) batch, runs one
forward pass over the paged KV cache and returns logits for the sequences that sample
(seed 000, "Chunked prefill": `pack(sequences)`; seed 003, block tables and slot mapping),
plus the rows of any other positions the caller names (prompt logprobs). A sequence given
drafts (speculative decoding: the scheduler's `draft_tokens`) runs its last token and the k
drafts after it and returns logits at all k + 1 positions.
It never decides who runs, nor which rows are wanted, nor which drafts to keep."""
from __future__ import annotations

import time

import numpy as np
import torch

from kvserve.engine.request import Request
from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.model import kv_quant
from kvserve.model.attention import (AttentionMetadata, PrefillChunk, TorchPagedAttention,
                                     build_decode_key_mask)
from kvserve.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.device = model.device
        # One preallocated pool per layer and K/V, in the attention backend's layout
        # ([num_blocks + 1, n_kv_heads, block_size, head_dim] for the portable backend: row 0 is
        # the null block, kv/block_pool.py); with a quantized kv_cache_dtype each pool is
        # (values, scales [num_blocks + 1, KV, block_size]).
        shape = model.attn.cache_shape(num_blocks + 1)
        self.kv_cache_dtype = model.attn.kv_cache_dtype
        self.forward_time_total = 0.0   # seconds inside the model's forward pass
        self.kv_connector = None        # KV tiers (kv/connector.py) run saves / loads through it
        self.kv_caches = [tuple(kv_quant.allocate(shape, self.kv_cache_dtype, model.dtype, self.device)
                                for _ in range(2)) for _ in range(cfg.num_layers)]

    # -- block moves for sharing and swapping (kv/manager.py queues them; run before execute) --
    def init_swap_space(self, num_cpu_blocks: int) -> None:
        """CPU copies of the per-layer pools, in the device pools' layout and dtypes."""
        self.cpu_caches = []
        if num_cpu_blocks <= 0:
            return
        shape = self.model.attn.cache_shape(num_cpu_blocks)    # CPU block ids 0.. (no null block)
        pin = self.device.type == "cuda"
        self.cpu_caches = [tuple(kv_quant.allocate(shape, self.kv_cache_dtype, self.model.dtype, "cpu",
                                                   pin_memory=pin, zeros=False) for _ in range(2))
                           for _ in self.kv_caches]

    @staticmethod
    def _pools(caches) -> list[torch.Tensor]:
        """Every tensor of every layer's K and V pools (values and scales when quantized)."""
        return [t for layer in caches for pool in layer for t in kv_quant.cache_tensors(pool)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy on write: block src -> dst in every layer's K and V cache."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for t in self._pools(self.kv_caches):
            t.index_copy_(0, dst, t.index_select(0, src))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block): copy device blocks into the CPU swap space."""
        if not pairs:
            return
        gpu = torch.tensor([g for g, _ in pairs], dtype=torch.long, device=self.device)
        cpu = torch.tensor([c for _, c in pairs], dtype=torch.long)
        for t, ct in zip(self._pools(self.kv_caches), self._pools(self.cpu_caches)):
            ct.index_copy_(0, cpu, t.index_select(0, gpu).cpu())

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block): copy swapped blocks back onto the device."""
        if not pairs:
            return
        cpu = torch.tensor([c for c, _ in pairs], dtype=torch.long)
        gpu = torch.tensor([g for _, g in pairs], dtype=torch.long, device=self.device)
        for t, ct in zip(self._pools(self.kv_caches), self._pools(self.cpu_caches)):
            t.index_copy_(0, gpu, ct.index_select(0, cpu).to(self.device, non_blocking=True))

    def apply_kv_ops(self, ops) -> None:
        """Run the manager's queued block moves: saves to the KV tiers (they read blocks this
        batch may overwrite), swap out, swap in, copies, then loads from the tiers."""
        if ops.saves:
            self.kv_connector.save_blocks(self, ops.saves)
        self.swap_out(ops.swap_out)
        self.swap_in(ops.swap_in)
        self.copy_blocks(ops.copies)
        if ops.loads:
            self.kv_connector.load_blocks(self, ops.loads)

    @staticmethod
    def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """K and V of every layer for block_size tokens (scales included when quantized)."""
        row = kv_quant.bytes_per_token_head(kv_cache_dtype, cfg.head_dim, dtype)
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row

    def execute(self, scheduled: list[tuple[Request, int, list[int]]],
                extra_rows: dict[str, range] | None = None, draft_tokens: dict[str, list[int]] | None = None
                ) -> tuple[torch.Tensor, list[Request], list[tuple[Request, int, torch.Tensor]]]:
        """scheduled: (request, num_new_tokens, block_ids). Returns logits [S, V] for the
        requests whose every known token is now computed (they sample), and those requests
        (a request with k `draft_tokens`, which its num_new_tokens count, has k + 1 rows);
        and, for each request id in `extra_rows` (positions inside its chunk whose logits are
        wanted too), (request, first position, logits [r, V])."""
        extra_rows = extra_rows or {}
        draft_tokens = draft_tokens or {}
        bs = self.block_size
        # Decodes (one new token) first, then prefill chunks: the backend's layout. A sequence
        # verifying drafts runs as k + 1 decode rows (the same block table, context lengths
        # start + 1 .. start + k + 1): its new K/V are written before attention reads them.
        def decodes(i):
            return scheduled[i][1] == 1 or scheduled[i][0].request_id in draft_tokens
        order = sorted(range(len(scheduled)), key=lambda i: not decodes(i))
        ids, pos, slots, logits_idx, samplers = [], [], [], [], []
        extra_idx, extras = [], []
        decode_tables, decode_lens, prefills = [], [], []
        offset = 0
        for i in order:
            req, n, block_ids = scheduled[i]
            start = req.num_computed_tokens
            extra = extra_rows.get(req.request_id)
            if extra:
                assert start <= extra.start and extra.stop <= start + n, f"{req}: rows {extra} not in chunk"
                extra_idx.extend(range(offset + extra.start - start, offset + extra.stop - start))
                extras.append((req, extra.start, len(extra)))
            p = np.arange(start, start + n)
            table = np.asarray(block_ids, dtype=np.int64)
            drafts = draft_tokens.get(req.request_id, ())
            ids.append((req.token_ids + drafts if drafts else req.token_ids)[start:start + n])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if decodes(i):
                decode_tables += [block_ids] * n
                decode_lens += range(start + 1, start + n + 1)
            else:
                prefills.append(PrefillChunk(offset, n, start + n,
                                             torch.from_numpy(table).to(self.device)))
            offset += n
            if start + n == req.num_tokens + len(drafts):
                logits_idx.extend(range(offset - 1 - len(drafts), offset))
                samplers.append(req)
        dev = self.device
        input_ids = torch.tensor([t for chunk in ids for t in chunk], dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos)).to(dev)
        meta = AttentionMetadata(slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
                                 num_decode_tokens=len(decode_lens), prefills=prefills)
        if decode_lens:
            width = max(len(t) for t in decode_tables)
            tables = np.full((len(decode_tables), width), NULL_BLOCK, dtype=np.int64)
            for row, t in enumerate(decode_tables):
                tables[row, :len(t)] = t
            meta.decode_block_tables = torch.from_numpy(tables).to(dev)
            meta.decode_context_lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            meta.decode_key_mask = build_decode_key_mask(
                meta.decode_context_lens, width * bs, self.model.attn.sliding_window)
        # Chunks that do not sample still run: their K/V must reach the cache.
        t0 = time.perf_counter()
        logits = self.forward(input_ids, positions, meta,
                              torch.tensor(logits_idx + extra_idx, dtype=torch.long, device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.forward_time_total += time.perf_counter() - t0
        rows, at = [], len(logits_idx)
        for req, first, r in extras:
            rows.append((req, first, logits[at:at + r]))
            at += r
        return logits[:len(logits_idx)], samplers, rows


    def forward(self, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        """One forward pass of the model over this runner's KV pools (the hook a tensor-parallel
        driver wraps to send the same pass to its workers: kvserve/distributed/executor.py)."""
        return self.model.forward(input_ids, positions, meta, self.kv_caches, logits_indices)


def make_attention_backend(cfg, block_size: int, kv_cache_dtype: str = "auto") -> TorchPagedAttention:
    return TorchPagedAttention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
                               cfg.sliding_window, kv_cache_dtype)
