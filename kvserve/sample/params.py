"""SamplingParams: how one request turns logits into tokens and when it stops (vLLM's names)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from kvserve.structured.params import StructuredOutputsParams  # noqa: F401 (re-exported)

# Limits that keep every accepted request computable: no accepted value makes a sampler step
# raise, overflow an int64 tensor or a float32 logit. Seeds feed torch.Generator.manual_seed,
# which takes [-2**63, 2**64 - 1]; kvserve takes the non-negative part, and sample i of n uses
# seed + i, so seed + n - 1 must stay <= 2**64 - 1.
INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1
MAX_LOGPROBS = 20                 # OpenAI's (and vLLM's default) limit on top logprobs
MAX_STOP_TOKEN_IDS = 1024
MAX_STOP_STRINGS = 16             # held-back text is checked against every stop string every step
MAX_STOP_STRING_CHARS = 1024
MAX_TEMPERATURE = 100.0           # as the OpenAI server's schema
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_ABS_LENGTH_PENALTY = 10.0     # seq_len ** length_penalty stays a finite, non-zero float
MAX_LOGIT_BIAS = 300              # OpenAI's limit on logit_bias entries
MAX_BAD_WORDS = 256               # bad_words strings (each checked against the output every step)
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 20   # allowed_token_ids entries (a mask over the vocabulary)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_finite_real(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    return isinstance(v, numbers.Integral) or math.isfinite(v)   # isfinite(10**400) would raise


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None        # None or -1: unseeded; sample i of n uses seed + i
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16   # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None   # top-k logprobs per generated token (0: the sampled token only)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (0: the prompt token only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's): -100
    # bans a token, 100 all but forces it. Logprobs stay those of the raw model distribution.
    logit_bias: dict[int, float] | None = None
    # Beam search (vLLM v0's fields): keep the `beam_width` most likely partial answers, ranked by
    # cumulative logprob / len ** length_penalty; returns the best `n`. Uses raw log-probabilities.
    use_beam_search: bool = False
    beam_width: int | None = None       # default: max(n, 2)
    length_penalty: float = 1.0         # beams only (vLLM's rule: any other value needs use_beam_search)
    # vLLM's: words never written. Each word's token sequences, with and without a leading space
    # (`update_from_tokenizer`), are banned: the last token's logit is -inf when the output ends
    # with the ones before it.
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None   # vLLM's: every other token's logit is -inf
    typical_p: float = 1.0              # locally typical sampling (HF's TypicalLogitsWarper); 1: off
    truncate_prompt_tokens: int | None = None    # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    # The output must match a JSON schema, regex, choice or grammar (kvserve/structured/).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: a PD pair's KV transfer (engine/remote_kv.py): {"transfer_id", "stream_to": "host:port"}
    # on the prefill instance, {"transfer_id"} on the decode instance
    kv_transfer_params: dict | None = None
    stop_strings: list[str] = field(init=False, repr=False)
    # stop_token_ids as a frozenset, kept in step with every assignment to stop_token_ids: the
    # per-step stop check (engine/output.py) is O(1) however many ids a request names.
    stop_token_id_set: frozenset = field(init=False, repr=False, compare=False)
    # bad_words as token-id sequences: set by `update_from_tokenizer` (the frontend's processor)
    bad_words_token_ids: list[list[int]] | None = field(init=False, default=None, repr=False)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "stop_token_ids":
            try:
                ids = frozenset(value) if isinstance(value, (list, tuple)) else frozenset()
            except TypeError:           # unhashable entries: validate() rejects them
                ids = frozenset()
            object.__setattr__(self, "stop_token_id_set", ids)

    def __post_init__(self):
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            self.stop_strings = [self.stop]          # validate() rejects anything but a string
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            self._fail(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}.")
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        if _is_int(self.seed) and self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.use_beam_search and self.beam_width is None:
            self.beam_width = max(self.n, 2) if _is_int(self.n) else 2
        self.validate()

    def _fail(self, msg: str):
        raise ValueError(msg)

    def _check_kv_transfer_params(self) -> None:
        ktp = self.kv_transfer_params
        if not isinstance(ktp, dict) or set(ktp) - {"transfer_id", "stream_to"}:
            self._fail("kv_transfer_params must be an object with 'transfer_id' (and, on a prefill "
                       f"instance, 'stream_to': 'host:port'), got {ktp!r}.")
        tid = ktp.get("transfer_id")
        if not isinstance(tid, str) or not 1 <= len(tid) <= 128:
            self._fail("kv_transfer_params.transfer_id must be a string of 1 to 128 characters.")
        if "stream_to" in ktp and not (isinstance(ktp["stream_to"], str) and ktp["stream_to"]):
            self._fail(f"kv_transfer_params.stream_to must be 'host:port', got {ktp['stream_to']!r}.")
        if self.use_beam_search:
            self._fail("kv_transfer_params cannot be used with beam search.")

    def _check_real(self, name: str, lo: float, hi: float, *, lo_open: bool = False, rule: str = "") -> None:
        v = getattr(self, name)
        ok = _is_finite_real(v) and (lo < v if lo_open else lo <= v) and v <= hi
        if not ok:
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            self._fail(f"{name} must be a finite number in {interval}{rule}, got {v!r}.")

    def validate(self) -> None:
        """Reject what no model could serve. Checks that need the model (token ids against the
        vocabulary) are in `verify_for_model`."""
        if not _is_int(self.n) or self.n < 1:
            self._fail(f"n must be an integer >= 1, got {self.n!r}.")
        if self.kv_transfer_params is not None:
            self._check_kv_transfer_params()
        self._check_real("temperature", 0.0, MAX_TEMPERATURE, rule=" (0 means greedy)")
        self._check_real("top_p", 0.0, 1.0, lo_open=True, rule=" (1 disables it)")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            self._fail(f"top_k must be an integer in [-1, 2**63 - 1] (0 or -1 disables it; values "
                       f"above the vocabulary size keep the whole vocabulary), got {self.top_k!r}.")
        self._check_real("min_p", 0.0, 1.0, rule=" (0 disables it)")
        self._check_real("presence_penalty", -2.0, 2.0)
        self._check_real("frequency_penalty", -2.0, 2.0)
        lo, hi = REPETITION_PENALTY_RANGE
        self._check_real("repetition_penalty", lo, hi, rule=" (1 disables it)")
        self._check_real("length_penalty", -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            self._fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            self._fail(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            self._fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                self._fail(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= SEED_MAX - (self.n - 1)):
            self._fail(f"seed must be an integer in [0, 2**64 - n] = [0, {SEED_MAX - (self.n - 1)}] for n={self.n} "
                       f"(sample i is seeded with seed + i, an unsigned 64-bit value), or -1 or None for "
                       f"no seed; got {self.seed!r}.")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            self._fail("stop must be a non-empty string or a list of non-empty strings.")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            self._fail(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strings)}.")
        longest = max((len(s) for s in self.stop_strings), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            self._fail(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long, got one "
                       f"of {longest}.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            self._fail(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}.")
        bad = next((t for t in self.stop_token_ids if not _is_int(t) or not 0 <= t <= INT64_MAX), None)
        if bad is not None:
            self._fail(f"stop_token_ids must be non-negative integers (token ids), got {bad!r}.")
        self._check_logit_bias()
        self._check_vocabulary_masks()
        self._check_real("typical_p", 0.0, 1.0, lo_open=True, rule=" (1 disables it)")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or 1 <= t <= INT64_MAX)):
            self._fail(f"truncate_prompt_tokens must be an integer >= 1, or -1 for max_model_len, got {t!r}.")
        if self.use_beam_search:
            if not _is_int(self.beam_width) or self.beam_width < 1:
                self._fail(f"beam_width must be an integer >= 1, got {self.beam_width!r}.")
            if self.n > self.beam_width:
                self._fail(f"n ({self.n}) must not exceed beam_width ({self.beam_width}).")
            if (self.top_k or self.top_p < 1.0 or self.min_p or self.uses_penalties or self.min_tokens
                    or self.stop_strings or self.logit_bias or self.typical_p < 1.0 or self.bad_words
                    or self.allowed_token_ids is not None):
                self._fail("beam search ranks raw log-probabilities: top_k, top_p, min_p, typical_p, "
                           "penalties, logit_bias, bad_words, allowed_token_ids, min_tokens and stop "
                           "strings are not supported with use_beam_search.")
        elif self.beam_width is not None:
            self._fail("beam_width needs use_beam_search=True.")
        elif self.length_penalty != 1.0:
            self._fail(f"length_penalty ({self.length_penalty!r}) only ranks beams: it needs "
                       "use_beam_search=True (vLLM's rule).")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            self._fail(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}.")
        if so is not None and self.use_beam_search:
            self._fail("structured_outputs is not supported with beam search (use_beam_search): "
                       "sample or decode greedily instead.")
        if so is not None and self.allowed_token_ids is not None:
            self._fail("allowed_token_ids and structured_outputs cannot be combined: give the allowed "
                       "tokens as the grammar (a choice or regex) instead.")

    def _check_vocabulary_masks(self) -> None:
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS:
                self._fail(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings, got {words!r:.80}.")
            if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
                self._fail(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} characters.")
            self.bad_words = list(words)
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
                self._fail(f"allowed_token_ids must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                           f"token ids, got {ids!r:.80}.")
            if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in ids):
                self._fail("allowed_token_ids must be non-negative integers (token ids).")
            self.allowed_token_ids = list(ids)

    def update_from_tokenizer(self, tokenizer) -> None:
        """bad_words as token ids (vLLM's rule): each word stripped of leading spaces, and again
        with one leading space when that gives a different first token and as many tokens (the
        word inside a text rather than at its start)."""
        if not self.bad_words:
            return
        if tokenizer is None:
            self._fail("bad_words needs a tokenizer: this model has none (use logit_bias with token ids).")
        seqs: list[list[int]] = []
        for word in self.bad_words:
            plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if plain:
                seqs.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                seqs.append(spaced)
        self.bad_words_token_ids = seqs

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            self._fail(f"logit_bias must map token ids to numbers, got {type(bias).__name__}.")
        if len(bias) > MAX_LOGIT_BIAS:
            self._fail(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}.")
        lo, hi = LOGIT_BIAS_RANGE
        for t, b in bias.items():
            if not _is_int(t) or not 0 <= t <= INT64_MAX:
                self._fail(f"logit_bias keys must be token ids (non-negative integers), got {t!r}.")
            if not _is_finite_real(b) or not lo <= b <= hi:
                self._fail(f"logit_bias values must be numbers in [{lo:g}, {hi:g}], got {b!r} for token {t}.")

    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that depend on the model: raise ValueError if these parameters cannot be served
        by a model with `vocab_size` tokens. (top_k above the vocabulary size is fine: it keeps
        the whole vocabulary.)"""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}.")
        bad = sorted(t for t in self.stop_token_id_set if t >= vocab_size)
        if bad:
            self._fail(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).")
        bad = sorted(t for t in self.logit_bias or () if t >= vocab_size)
        if bad:
            self._fail(f"logit_bias token ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).")
        bad = sorted({t for t in self.allowed_token_ids or () if t >= vocab_size})
        if bad:
            self._fail(f"allowed_token_ids {bad[:8]} are outside the vocabulary [0, {vocab_size}).")
        bad = sorted({t for seq in self.bad_words_token_ids or () for t in seq if not 0 <= t < vocab_size})
        if bad:
            self._fail(f"bad_words tokenize to ids {bad[:8]} outside the vocabulary [0, {vocab_size}).")
        if self.allowed_token_ids is not None and self.bad_words_token_ids:
            banned = {seq[0] for seq in self.bad_words_token_ids if len(seq) == 1}
            if banned.issuperset(self.allowed_token_ids):
                self._fail("bad_words ban every token of allowed_token_ids: no token is left to sample.")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > vocab_size:
                self._fail(f"{name} ({v}) must not exceed the vocabulary size ({vocab_size}).")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def masks_vocabulary(self) -> bool:
        """allowed_token_ids or bad_words: -inf on some tokens before anything else."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

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


@dataclass(slots=True)
class Sampled:
    """One position's token and its log-probability under the raw model distribution: its rank
    (1 = most likely) and, when asked for, the top-k alternatives as (token id, logprob)."""

    token_id: int
    logprob: float = 0.0
    rank: int = 0
    top: list[tuple[int, float]] | None = None
