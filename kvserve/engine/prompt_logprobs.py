"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the log-probability of every
prompt token given the tokens before it, with the top-k alternatives.

Token j's entry comes from the logits at position j - 1, so a prefill chunk over positions
[start, start + n) can give the entries of tokens start + 1 .. start + n. The engine asks the
runner for the rows of `positions(req, n)`; the step sampler turns them (worker/sampling.py) into `Sampled` values, which
the scheduler counts on the group's head (`Request.num_prompt_logprobs`, 1 from its construction
for the first token, which nothing predicts) and sends out as deltas.

Each entry is made once: the positions asked for start where the recorded entries end, so a
prompt recomputed after preemption (or one that arrives over several chunks) asks only for
what is missing; and a request whose entries are incomplete takes no prefix-cache hit
(`Request.must_compute_prompt`), so no prompt position is skipped.
"""
from __future__ import annotations

from kvserve.engine.request import Request


def positions(req: Request, num_new_tokens: int) -> range:
    """Positions of this chunk, [num_computed, num_computed + n), whose logits give entries
    not yet recorded (the last prompt position predicts the first output: not an entry)."""
    if req.num_prompt_logprobs is None:
        return range(0)
    first = max(req.num_computed_tokens, req.num_prompt_logprobs - 1)
    end = min(req.num_computed_tokens + num_new_tokens, req.num_prompt_tokens - 1)
    return range(first, max(first, end))


def wanted_rows(scheduled: list[tuple[Request, int]]) -> dict[str, range]:
    """{request id: positions} for this step's chunks that give prompt entries."""
    wanted = {req.request_id: positions(req, n) for req, n in scheduled}
    return {rid: rows for rid, rows in wanted.items() if rows}
