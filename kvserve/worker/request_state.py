"""The worker's copy of each live sequence (vLLM v1's CachedRequestState), kept across steps.

Built from a NewSequenceData, then advanced by the tokens the worker samples for it and by the
core's CachedSequenceData (worker/scheduler_output.py); dropped when the core names the
sequence finished. The input
batch reads its tokens, computed count and block table; the sampler reads its parameters,
output tokens (penalties, min_tokens) and its own seeded generator, which lives here so a
seeded sample's draws do not depend on the rest of the batch and go on where they left off
after a preemption."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.sample.params import SamplingParams
from kvserve.worker.scheduler_output import CachedSequenceData, NewSequenceData
from kvserve.worker.sequence import PromptAndOutput


@dataclass
class SequenceState(PromptAndOutput):
    request_id: str                  # the sequence id (the sampler and the input batch read this name)
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None
    eos_token_id: int | None
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None     # made on first seeded draw (sample/sampler.py)
    grammar_bitmask: object = None               # this step's allowed tokens (np.ndarray), or None

    @classmethod
    def from_new(cls, d: NewSequenceData) -> "SequenceState":
        return cls(d.seq_id, list(d.token_ids), d.num_prompt_tokens, d.params, d.seed, d.eos_token_id)

    def update(self, d: CachedSequenceData) -> None:
        self.token_ids.extend(d.new_token_ids)
        if d.block_ids is not None:
            self.block_ids = d.block_ids
        elif d.new_block_ids:
            self.block_ids.extend(d.new_block_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]
