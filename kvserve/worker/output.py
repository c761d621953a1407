"""ModelRunnerOutput: what one step's forward pass and sampling produced, as values.

The runner decides nothing about requests: it returns, by sequence id, the tokens sampled (one,
or a verified speculative run: accepted drafts then the target's token), a beam's candidates,
new prompt-logprob entries, and failures as messages (`grammar_errors`: the sequence's own
grammar failed, the user's error; `failed`: anything else). The scheduler alone applies them
(`Scheduler.update_from_output`), so every field of a Request has one writer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sample.params import Sampled


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, list[Sampled]] = field(default_factory=dict)          # seq id -> tokens
    beam_candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[Sampled]] = field(default_factory=dict)  # head id -> entries
    failed: dict[str, str] = field(default_factory=dict)                     # seq id -> why
    grammar_errors: dict[str, str] = field(default_factory=dict)             # seq id -> why (its grammar's)
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)        # speculation's seq id -> a

    def fail(self, seq_id: str, e: BaseException) -> None:
        self.failed[seq_id] = f"{type(e).__name__}: {e}"
        self.sampled.pop(seq_id, None)
