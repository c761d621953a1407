"""SamplingParams: how one request turns logits into tokens and when it stops (vLLM's names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16   # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None   # top-k logprobs per generated token (0: the sampled token only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Beam search (vLLM v0's fields): keep the `beam_width` most likely partial answers, ranked by
    # cumulative logprob / len ** length_penalty; returns the best `n`. Uses raw log-probabilities.
    use_beam_search: bool = False
    beam_width: int | None = None       # default: max(n, 2)
    length_penalty: float = 1.0
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = max(self.n, 2) if isinstance(self.n, int) else 2
        self.validate()

    def _fail(self, msg: str):
        raise ValueError(msg)

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            self._fail(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0:
            self._fail(f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            self._fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            self._fail(f"top_k must be a non-negative integer (0 or -1 disables it), got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            self._fail(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            self._fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            self._fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0:
            self._fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            self._fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            self._fail(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            self._fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            self._fail(f"logprobs must be a non-negative integer, got {self.logprobs!r}.")
        if self.seed is not None and not isinstance(self.seed, int):
            self._fail(f"seed must be an integer, got {self.seed!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            self._fail("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            self._fail("stop_token_ids must be non-negative integers.")
        if self.use_beam_search:
            if not isinstance(self.beam_width, int) or self.beam_width < 1:
                self._fail(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
            if self.n > self.beam_width:
                self._fail(f"n ({self.n}) must not exceed beam_width ({self.beam_width}).")
            if (self.top_k or self.top_p < 1.0 or self.min_p or self.uses_penalties or self.min_tokens
                    or self.stop_strings):
                self._fail("beam search ranks raw log-probabilities: top_k, top_p, min_p, penalties, "
                           "min_tokens and stop strings are not supported with use_beam_search.")
        elif self.beam_width is not None:
            self._fail("beam_width needs use_beam_search=True.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """vLLM's offline beam-search parameters: `LLM.beam_search(prompts, BeamSearchParams(...))`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0            # accepted for vLLM compatibility; beams rank raw logprobs
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.beam_width, use_beam_search=True, beam_width=self.beam_width,
                              length_penalty=self.length_penalty, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=0.0, logprobs=0)
