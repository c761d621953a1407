"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the log-probability of every
prompt token given the tokens before it, with the top-k alternatives.

Token j's entry comes from the logits at position j - 1, so a prefill chunk over positions
[start, start + n) can give the entries of tokens start + 1 .. start + n. The engine asks the
runner for the rows of `positions(req, n)` and hands them to `record`, which appends to the
group head's `Request.prompt_logprobs` ([None] for the first token, which nothing predicts).

Each entry is recorded once: the positions asked for start where the recorded entries end,
so a prompt recomputed after preemption (or one that arrives over several chunks) asks only
for what is missing; and a request whose entries are incomplete takes no prefix-cache hit
(`Request.must_compute_prompt`), so no prompt position is skipped.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvserve.engine.request import Request
from kvserve.outputs import logprob_entry
from kvserve.sample.sampler import token_logprobs


def start(req: Request) -> None:
    """At add_request, on the group's head only (the samples and beams it forks share its
    prompt): the first token has no entry."""
    req.prompt_logprobs = [None] if req.params.prompt_logprobs is not None else None


def positions(req: Request, num_new_tokens: int) -> range:
    """Positions of this chunk, [num_computed, num_computed + n), whose logits give entries
    not yet recorded (the last prompt position predicts the first output: not an entry)."""
    if req.prompt_logprobs is None:
        return range(0)
    first = max(req.num_computed_tokens, len(req.prompt_logprobs) - 1)
    end = min(req.num_computed_tokens + num_new_tokens, req.num_prompt_tokens - 1)
    return range(first, max(first, end))


def wanted_rows(scheduled: list[tuple[Request, int]]) -> dict[str, range]:
    """{request id: positions} for this step's chunks that give prompt entries."""
    wanted = {req.request_id: positions(req, n) for req, n in scheduled}
    return {rid: rows for rid, rows in wanted.items() if rows}


def snapshot(req: Request) -> list | None:
    """What an output carries: a copy of the entries recorded so far (None if not asked for)."""
    return list(req.prompt_logprobs) if req.prompt_logprobs is not None else None


@torch.inference_mode()
def record(req: Request, first: int, logits: torch.Tensor, piece: Callable[[int], str | None]) -> None:
    """Append the entries of prompt tokens first + 1 .. first + r from `logits` [r, V], the raw
    rows at positions first .. first + r - 1: the token's logprob (log_softmax, the raw model
    distribution, like the sampler's) and rank, and the top `prompt_logprobs` tokens."""
    entries = req.prompt_logprobs
    assert first + 1 == len(entries), f"{req}: prompt entries {len(entries)}, rows from position {first}"
    r = logits.shape[0]
    targets = req.prompt_token_ids[first + 1:first + 1 + r]
    chosen, ranks, top_ids, top_lps = token_logprobs(
        logits, torch.tensor(targets, dtype=torch.long, device=logits.device), req.params.prompt_logprobs)
    for tid, c, rank, ids, lps in zip(targets, chosen, ranks, top_ids, top_lps):
        entries.append(logprob_entry(tid, c, rank, zip(ids, lps), piece))
