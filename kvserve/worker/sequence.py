"""What the model runner reads of a sequence (the scheduler's Request satisfies it; a draft
model's own sequences are these), and the token counts a prompt + output sequence derives."""
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


class PromptAndOutput:
    """What follows from a sequence's `token_ids` (prompt + output) and `num_prompt_tokens`: the
    scheduler's Request and the worker's SequenceState (worker/request_state.py) both read so."""

    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
