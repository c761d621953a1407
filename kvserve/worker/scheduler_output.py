"""SchedulerOutput: one step's work as data, what the core sends the worker (vLLM v1's worker seam).

A sequence's data crosses once (`NewSequenceData`: its tokens so far, sampling parameters, seed),
the first step it is scheduled or waits to fork; after that only what changed does
(`CachedSequenceData`, for a sequence whose tokens or blocks changed otherwise than the worker
knows: tokens the worker did not sample itself, such as a beam's chosen token; its block ids
appended, or its whole table when it changed otherwise), until `finished_seq_ids` names it and
the worker forgets it. The worker keeps its own copy of every live sequence
(worker/request_state.py) and appends the tokens it samples to it, so it never reads the
scheduler's Request objects, and a plain decode step sends one tuple per sequence. A
tensor-parallel rank is sent the same object (kvserve/distributed/executor.py). Everything here
is ints, lists and numpy arrays: it pickles small.

Per step: `scheduled` (seq id, new tokens, the position of the first: how many tokens already
have K/V) in the scheduler's order; `draft_tokens` (speculative
decoding: the drafts after a sequence's last token, counted in its n); `prompt_logprob_rows`
(positions inside a chunk whose logits are wanted, for prompt logprobs); `fork_waiters` (samples
of n > 1 that draw their first token from their head's row); `grammar_bitmask` (structured
outputs: each constrained sampling sequence's allowed tokens, llguidance's packed int32 words,
bit j of word w = token 32 w + j) and `grammar_errors` (constrained sequences whose grammar
allows nothing here: they do not sample, and the scheduler fails them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvserve.sample.params import SamplingParams


@dataclass
class NewSequenceData:
    seq_id: str
    token_ids: list[int]            # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None                # this sample's seed (params.seed + index), None: the engine's generator
    eos_token_id: int | None


@dataclass
class CachedSequenceData:
    seq_id: str
    new_token_ids: list[int]        # appended by the scheduler, not sampled by the worker, since last sent
    new_block_ids: list[int]        # appended to its block table since last sent
    block_ids: list[int] | None     # its whole new block table when it changed otherwise (copy on
                                    # write, rollback, preemption, swap in), else None


@dataclass
class SchedulerOutput:
    new_seqs: list[NewSequenceData] = field(default_factory=list)
    cached_seqs: list[CachedSequenceData] = field(default_factory=list)
    scheduled: list[tuple[str, int, int]] = field(default_factory=list)     # (seq id, num new tokens, start)
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    prompt_logprob_rows: dict[str, range] = field(default_factory=dict)     # seq id -> positions
    fork_waiters: dict[str, list[str]] = field(default_factory=dict)        # head seq id -> waiters
    grammar_bitmask: dict[str, np.ndarray] = field(default_factory=dict)    # seq id -> [ceil(V/32)] int32
    grammar_errors: dict[str, str] = field(default_factory=dict)            # seq id -> why
    finished_seq_ids: list[str] = field(default_factory=list)
