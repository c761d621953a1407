"""What the model runner reads of a sequence (the scheduler's Request satisfies it; a draft
model's own sequences are these)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunnerSequence:
    """A sequence as ModelRunner.execute reads it: its id, its tokens and how many have K/V."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
