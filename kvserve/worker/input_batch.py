"""The model runner's input batch, kept across steps (vLLM v1's InputBatch, much smaller).

Host buffers are preallocated (pinned when the device is CUDA) and grow by doubling when a step
needs more; each has a device mirror filled with one non_blocking copy (on a CPU device the
mirror is the buffer itself). A step writes its inputs into them: input ids, positions, slot
mapping, logits indices, and for decode rows their block-table row and context length.

Block tables are rows kept per request (`BlockTableRows`): a request keeps its row while it is
scheduled step after step, and a table that only grew is updated by writing its new block ids;
one that changed otherwise (copy on write, rollback, preemption) is rewritten. Padding is
NULL_BLOCK (kv/block_pool.py), never a live block. Rows of requests absent from a step are
released and the last row moves into the hole, so rows [0, num_rows) stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk


class HostDeviceBuffer:
    """A host tensor (pinned on CUDA) with a numpy view and a device mirror of the same shape."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, dtype=torch.int64):
        self.device = device
        self.cpu = torch.full(shape, NULL_BLOCK, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        self.dev = self.cpu if device.type == "cpu" else torch.empty_like(self.cpu, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n entries (rows) on the device: one non_blocking copy, none on a CPU device."""
        if self.dev is not self.cpu:
            self.dev[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.dev[:n]

    def grown(self, shape: tuple[int, ...]) -> "HostDeviceBuffer":
        """A larger buffer holding this one's contents in its leading corner."""
        new = HostDeviceBuffer(shape, self.device, self.cpu.dtype)
        new.np[tuple(slice(0, s) for s in self.np.shape)] = self.np
        return new


def _capacity(need: int, have: int) -> int:
    while have < need:
        have *= 2
    return have


class BlockTableRows:
    """Block tables as rows of one [max_rows, max_blocks] int64 buffer, one row per request."""

    def __init__(self, device: torch.device, max_rows: int = 16, max_blocks: int = 64):
        self.buf = HostDeviceBuffer((max_rows, max_blocks), device)
        self.row_of: dict[str, int] = {}
        self.req_ids: list[str] = []              # row -> request id
        self.written: list[list[int]] = []        # row -> the block ids it holds
        self.dirty = False                        # rows changed since the last to_device
        self.num_written_ids = 0                  # block ids written since construction (tests)

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    def keep_only(self, request_ids: set[str]) -> None:
        """Release the rows of every other request (the last row fills each hole)."""
        for rid in [r for r in self.req_ids if r not in request_ids]:
            row, last = self.row_of.pop(rid), len(self.req_ids) - 1
            if row != last:
                moved = self.req_ids[last]
                self.buf.np[row] = self.buf.np[last]
                self.req_ids[row], self.written[row] = moved, self.written[last]
                self.row_of[moved] = row
            self.buf.np[last] = NULL_BLOCK
            self.req_ids.pop()
            self.written.pop()
            self.dirty = True

    def update(self, request_id: str, block_ids: list[int]) -> int:
        """The request's row, holding `block_ids` (written incrementally when the table only grew)."""
        row = self.row_of.get(request_id)
        if row is None:
            row = self.row_of[request_id] = len(self.req_ids)
            self.req_ids.append(request_id)
            self.written.append([])
            if row >= self.buf.np.shape[0]:
                self.buf = self.buf.grown((2 * self.buf.np.shape[0], self.buf.np.shape[1]))
        old, n = self.written[row], len(block_ids)
        if n > self.buf.np.shape[1]:
            self.buf = self.buf.grown((self.buf.np.shape[0], _capacity(n, self.buf.np.shape[1])))
        k = len(old)
        if k <= n and block_ids[:k] == old:          # grew (or unchanged): write the new ids only
            if k < n:
                self.buf.np[row, k:n] = block_ids[k:]
                old.extend(block_ids[k:])
                self.num_written_ids += n - k
                self.dirty = True
            return row
        self.buf.np[row, :n] = block_ids
        self.buf.np[row, n:max(k, n)] = NULL_BLOCK
        self.written[row] = list(block_ids)
        self.num_written_ids += n
        self.dirty = True
        return row

    def to_device(self) -> torch.Tensor:
        """[num_rows, max_blocks] on the device (copied only when a row changed)."""
        if self.dirty or self.buf.dev is self.buf.cpu:
            self.dirty = False
            return self.buf.to_device(self.num_rows)
        return self.buf.dev[:self.num_rows]


class StepBuffers:
    """The per-token inputs of one step: [max_tokens] host buffers and their device mirrors."""

    NAMES = ("input_ids", "positions", "slot_mapping", "token_rows", "logits_indices")

    def __init__(self, device: torch.device, max_tokens: int = 256):
        self.device = device
        self.bufs = {name: HostDeviceBuffer((max_tokens,), device) for name in self.NAMES}

    def reserve(self, num_tokens: int) -> None:
        have = self.bufs["input_ids"].np.shape[0]
        if num_tokens > have:
            size = _capacity(num_tokens, have)
            self.bufs = {name: HostDeviceBuffer((size,), self.device) for name in self.NAMES}

    def np(self, name: str) -> np.ndarray:
        return self.bufs[name].np

    def to_device(self, name: str, n: int) -> torch.Tensor:
        return self.bufs[name].to_device(n)


@dataclass
class StepInputs:
    """One step's packed batch: what the forward pass reads and how to split its logits."""

    input_ids: torch.Tensor            # [T]
    positions: torch.Tensor            # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor       # [S + E]: the sampling rows, then the extra rows
    samplers: list                     # the requests that sample (a request with k drafts has k + 1 rows)
    extras: list[tuple]                # (request, first position, number of rows) per extra_rows entry
    num_sample_rows: int               # S


class InputBatch:
    """Writes each step's scheduled tokens into the persistent buffers and block-table rows."""

    def __init__(self, device: torch.device, block_size: int):
        self.device, self.block_size = device, block_size
        self.rows = BlockTableRows(device)
        self.bufs = StepBuffers(device)

    def prepare(self, scheduled, extra_rows: dict[str, range], draft_tokens: dict[str, list[int]]) -> StepInputs:
        """scheduled: (request, num_new_tokens, block_ids). Decodes (one new token, or a token
        and its k drafts: k + 1 decode rows over one block table, context lengths start + 1 ..
        start + k + 1) come first, then prefill chunks: the attention backend's layout."""
        bs = self.block_size
        is_decode = [n == 1 or r.request_id in draft_tokens for r, n, _ in scheduled]
        order = [e for e, d in zip(scheduled, is_decode) if d] + [e for e, d in zip(scheduled, is_decode) if not d]
        T = sum(n for _, n, _ in scheduled)
        self.bufs.reserve(T)
        self.rows.keep_only({r.request_id for r, _, _ in scheduled})
        ids = self.bufs.np("input_ids")
        rows, starts, lens, chunks = [], [], [], []
        logits_idx, extra_idx, extras, samplers = [], [], [], []
        num_decodes, decode_ctx, offset = sum(is_decode), 0, 0
        for i, (req, n, block_ids) in enumerate(order):
            rid, start, tokens = req.request_id, req.num_computed_tokens, req.token_ids
            row = self.rows.update(rid, block_ids)
            drafts = draft_tokens.get(rid, ())
            if n == 1:
                ids[offset] = tokens[start]
            else:
                known = min(n, len(tokens) - start)
                ids[offset:offset + known] = tokens[start:start + known]
                if known < n:                      # the drafts after the last known token
                    ids[offset + known:offset + n] = drafts[:n - known]
            extra = extra_rows.get(rid)
            if extra:
                assert start <= extra.start and extra.stop <= start + n, f"{req}: rows {extra} not in chunk"
                extra_idx.extend(range(offset + extra.start - start, offset + extra.stop - start))
                extras.append((req, extra.start, len(extra)))
            rows.append(row)
            starts.append(start)
            lens.append(n)
            if i < num_decodes:
                decode_ctx = max(decode_ctx, start + n)
            else:
                chunks.append((offset, n, start + n, row))
            offset += n
            if start + n == req.num_tokens + len(drafts):
                logits_idx.extend(range(offset - 1 - len(drafts), offset))
                samplers.append(req)
        num_decode_tokens = sum(lens[:num_decodes])
        # positions, the row of each token and its slot, vectorized over the step's tokens
        lens_np = np.asarray(lens)
        first = np.cumsum(lens_np) - lens_np                                   # [R] flat offsets
        pos = self.bufs.np("positions")[:T]
        np.subtract(np.arange(T), np.repeat(first - np.asarray(starts), lens_np), out=pos)
        token_rows = self.bufs.np("token_rows")[:T]
        token_rows[:] = np.repeat(np.asarray(rows), lens_np)
        table = self.rows.buf.np                                                # [max_rows, max_blocks]
        slots = self.bufs.np("slot_mapping")[:T]
        np.take(table.reshape(-1), token_rows * table.shape[1] + pos // bs, out=slots)
        slots *= bs
        slots += pos % bs
        wanted = logits_idx + extra_idx
        self.bufs.np("logits_indices")[:len(wanted)] = wanted
        # one copy per buffer onto the device
        input_ids = self.bufs.to_device("input_ids", T)
        positions = self.bufs.to_device("positions", T)
        tables = self.rows.to_device()                                          # [num_rows, max_blocks]
        meta = AttentionMetadata(slot_mapping=self.bufs.to_device("slot_mapping", T),
                                 num_decode_tokens=num_decode_tokens,
                                 prefills=[PrefillChunk(o, n, ctx, tables[row]) for o, n, ctx, row in chunks])
        if num_decode_tokens:
            width = -(-decode_ctx // bs)
            decode_rows = self.bufs.to_device("token_rows", num_decode_tokens)
            meta.decode_block_tables = tables[:, :width].index_select(0, decode_rows)   # [D, width]
            meta.decode_context_lens = positions[:num_decode_tokens] + 1
        return StepInputs(input_ids, positions, meta, self.bufs.to_device("logits_indices", len(wanted)),
                          samplers, extras, len(logits_idx))
