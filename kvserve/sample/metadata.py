"""One step's sampling parameters as arrays (vLLM v1's SamplingMetadata), and the table the
worker keeps them in across steps (the sampling half of vLLM v1's persistent InputBatch).

A sequence's parameters are turned into numbers once, when it joins the worker
(`SamplingTable.add`): a row of per-column arrays (temperature, top-k, top-p, min-p, typical-p,
the top-logprobs count, and flags for the stages that need the sequence's own tokens:
penalties, vocabulary masks, logit_bias, min_tokens). A step gathers its sampling rows' entries
with one index per column (`SamplingTable.gather`) instead of reading every request's
`SamplingParams` again, and the sampler (sample/sampler.py) reads only those arrays; the
per-row Python stages run over the rows whose flag is set, not over the batch. A caller without
a table (speculative verification's look-ahead rows, a tool) builds the same arrays from the
parameters directly (`SamplingMetadata.build`): both go through `_row`, so the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.sample.params import SamplingParams

# column -> numpy dtype; each row's values come from `_row`
COLUMNS = {
    "temperature": np.float32,   # 1.0 for a greedy row (it is never divided)
    "top_k": np.int64,           # the vocabulary size where off (0, -1 or past V)
    "top_p": np.float32,
    "min_p": np.float32,
    "typical_p": np.float32,
    "logprobs": np.int64,        # top logprobs asked for; -1: none (not even the sampled token's)
    "greedy": np.bool_,
    "penalties": np.bool_,       # presence, frequency or repetition penalty
    "vocab_mask": np.bool_,      # allowed_token_ids or bad_words
    "logit_bias": np.bool_,
    "min_tokens": np.bool_,      # min_tokens > 0: its stop tokens masked while the output is short
}


def _row(p: SamplingParams, vocab_size: int) -> tuple:
    """One sequence's entries, in COLUMNS' order."""
    return (1.0 if p.greedy else p.temperature, min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size,
            p.top_p, p.min_p, p.typical_p, -1 if p.logprobs is None else p.logprobs, p.greedy,
            p.uses_penalties, p.masks_vocabulary, bool(p.logit_bias), p.min_tokens > 0)


@dataclass
class SamplingMetadata:
    """The sampling rows of one step, S of them, in the sampler's order."""

    vocab_size: int
    temperature: torch.Tensor          # [S] float32
    top_k: torch.Tensor                # [S] int64
    top_p: torch.Tensor                # [S] float32
    min_p: torch.Tensor                # [S] float32
    typical_p: torch.Tensor            # [S] float32
    logprobs: np.ndarray               # [S] int64, -1: none
    greedy: np.ndarray                 # [S] bool
    penalty_rows: list[int]            # rows with a penalty
    vocab_rows: list[int]              # rows with allowed_token_ids or bad words
    bias_rows: list[int]               # rows with a logit_bias
    min_tokens_rows: list[int]         # rows with min_tokens > 0 (masked only while short)
    random_rows: list[int]             # rows that draw (not greedy)

    @classmethod
    def from_columns(cls, cols: dict[str, np.ndarray], vocab_size: int, device) -> "SamplingMetadata":
        def t(name):
            return torch.from_numpy(cols[name]).to(device)
        return cls(vocab_size, t("temperature"), t("top_k"), t("top_p"), t("min_p"), t("typical_p"),
                   cols["logprobs"], cols["greedy"], np.flatnonzero(cols["penalties"]).tolist(),
                   np.flatnonzero(cols["vocab_mask"]).tolist(), np.flatnonzero(cols["logit_bias"]).tolist(),
                   np.flatnonzero(cols["min_tokens"]).tolist(), np.flatnonzero(~cols["greedy"]).tolist())

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device="cpu") -> "SamplingMetadata":
        """The arrays of `params`, one row each, without a table."""
        rows = [_row(p, vocab_size) for p in params]
        cols = {name: np.array([r[j] for r in rows], dtype=dt) for j, (name, dt) in enumerate(COLUMNS.items())}
        return cls.from_columns(cols, vocab_size, device)

    @property
    def all_greedy(self) -> bool:
        return not self.random_rows


class SamplingTable:
    """Every live sequence's sampling parameters as one row of persistent numpy columns,
    written once when it joins (`add`) and freed when it leaves (`remove`); rows are reused."""

    def __init__(self, vocab_size: int, device, capacity: int = 64):
        self.vocab_size, self.device = vocab_size, device
        self.cols = {name: np.zeros(capacity, dtype=dt) for name, dt in COLUMNS.items()}
        self.row_of: dict[str, int] = {}
        self.free: list[int] = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, seq_id: str, params: SamplingParams) -> None:
        if seq_id in self.row_of:
            self.remove(seq_id)
        if not self.free:
            n = len(self.cols["greedy"])
            self.cols = {name: np.concatenate([c, np.zeros(n, dtype=c.dtype)]) for name, c in self.cols.items()}
            self.free = list(range(2 * n - 1, n - 1, -1))
        row = self.row_of[seq_id] = self.free.pop()
        for (name, _), v in zip(COLUMNS.items(), _row(params, self.vocab_size)):
            self.cols[name][row] = v

    def remove(self, seq_id: str) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is not None:
            self.free.append(row)

    def gather(self, seq_ids: list[str]) -> SamplingMetadata:
        """The metadata of these sequences' rows, in this order (each must have been added)."""
        idx = np.fromiter((self.row_of[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        return SamplingMetadata.from_columns({name: c[idx] for name, c in self.cols.items()},
                                             self.vocab_size, self.device)
