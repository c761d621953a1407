"""The proposer interface and n-gram prompt lookup (vLLM's `method="ngram"`; Saxena's
prompt-lookup decoding; seed 004's cheapest proposer: the text often repeats itself).

`Proposer.propose(requests, num_drafts)` returns, for each request, at most `num_drafts[i]`
draft token ids guessed to follow `request.token_ids` (possibly none). Proposers guess; they
never decide who speculates (the scheduler does) nor whether a guess is right (the target does).
Every proposer here proposes a single sequence per request with a point-mass distribution, so
verification (sample/rejection.py) needs no draft probabilities.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class Proposer:
    def propose(self, requests: Sequence, num_drafts: Sequence[int]) -> list[list[int]]:
        raise NotImplementedError

    def release(self, live_ids: set[str]) -> None:
        """Forget per-sequence state (a draft model's KV) of sequences not in `live_ids`."""


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Match the last n tokens (n from `n_max` down to `n_min`: the longest match wins) against
    earlier positions of `tokens`; propose the (up to) k tokens that followed the most recent
    earlier occurrence. [] when no suffix of length >= n_min occurs earlier. O(L) per call:
    only the positions holding the last token are candidates, extended backwards together."""
    L = len(tokens)
    if k <= 0 or L < n_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:L - 1] == arr[L - 1])       # [c]: where a match could end
    length = 1
    while ends.size and length < min(n_max, L - 1):
        ok = ends >= length
        ok[ok] = arr[ends[ok] - length] == arr[L - 1 - length]
        if not ok.any():
            break
        ends, length = ends[ok], length + 1
    if not ends.size or length < n_min:
        return []
    start = int(ends[-1]) + 1                              # what followed the latest match
    return arr[start:start + k].tolist()


class NgramProposer(Proposer):
    """Prompt lookup over the sequence's own prompt and output (`prompt_lookup_min`,
    `prompt_lookup_max`, up to `num_speculative_tokens` drafts). No model, no state."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests, num_drafts):
        return [ngram_lookup(r.token_ids, k, self.n_min, self.n_max) for r, k in zip(requests, num_drafts)]
