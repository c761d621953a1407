"""Bounds on the work one HTTP request can cause, checked before the work is done.

- The served `max_model_len` is the core's (`CoreLimits.max_model_len`, engine/engine_core.py):
  what the KV pool can hold when that is less than the model's context (`--num-kv-blocks 24
  --block-size 16` is 384 tokens), with a warning, so that `/v1/models` never advertises a
  context that no request could use and a request asking for more is refused with 400 up front
  instead of stopping short with `finish_reason: "length"`. (vLLM refuses to start instead; a
  small pool is a legitimate setting -- tests, small devices -- so kvserve serves what fits and
  says so, the same number in the server, the frontend's checks and the scheduler.)
- At most `max_prompts_per_request` prompts in one `/v1/completions` body (vLLM has no such
  limit; `--max-prompts-per-request`, default 1024), and never more than `--max-waiting`, which
  such a batch could never fit under (400, not a 503 that retrying cannot cure).
- List fields are counted before pydantic looks at their items (`check_list_lengths`): a
  4-million-entry `stop_token_ids` costs a `len()`, not a validation pass.
- A text prompt longer in UTF-8 bytes than `max_model_len` times the most bytes any one token
  stands for cannot fit, and is refused before it is tokenized (`check_text_fits`). What is
  tokenized is tokenized on a small worker pool (`Tokenization`), not on the event loop, so a
  long prompt never stalls `/health` or another client's stream.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.server.openai.protocol import LIST_FIELD_LIMITS, APIError

logger = logging.getLogger("kvserve.server")

DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
ADD_CHUNK = 64                  # engine requests queued per turn of the event loop
INLINE_TOKENIZE_CHARS = 2048    # shorter text is tokenized on the event loop (microseconds)
TOKENIZER_THREADS = 2
MIN_BYTES_PER_TOKEN_BOUND = 16  # a floor for the bound below (normalizers, special tokens)


def max_bytes_per_token(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes of input text one token can stand for: 4 x the longest
    vocabulary entry in bytes of its own spelling, and never below MIN_BYTES_PER_TOKEN_BOUND.

    A spelling is never shorter than the normalized text it stands for (a byte-level BPE spells
    each byte with a 1-2 byte character, sentencepiece a space with the 3-byte U+2581), and a
    normalizer shrinks text at most 4:1 (NFKC maps 4-byte U+1D400 to "A"). Only a normalizer
    that deletes characters outright (control characters) beats it, and a prompt made of those
    is no loss."""
    longest = 0
    inner = getattr(tokenizer, "_tok", None)                    # HFTokenizer
    pieces = getattr(tokenizer, "pieces", None)                 # Llama2cTokenizer
    try:
        if inner is not None:
            longest = max((len(t.encode("utf-8")) for t in inner.get_vocab(with_added_tokens=True)),
                          default=0)
        elif pieces is not None:
            longest = max((len(p) for p in pieces), default=0)
        else:
            longest = int(getattr(tokenizer, "max_token_length", 0) or 64)
    except Exception:  # noqa: BLE001 -- an unusual tokenizer: fall back to a generous bound
        logger.warning("cannot read the tokenizer's vocabulary; assuming tokens of 64 bytes at most")
        longest = 64
    return max(4 * longest, MIN_BYTES_PER_TOKEN_BOUND)


@dataclass
class ServerLimits:
    max_model_len: int
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_waiting: int | None = None
    bytes_per_token: int = MIN_BYTES_PER_TOKEN_BOUND

    def __post_init__(self):
        if self.max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be >= 1, got {self.max_prompts_per_request}.")

    @property
    def max_prompt_bytes(self) -> int:
        return self.max_model_len * self.bytes_per_token

    def check_list_lengths(self, obj: dict) -> None:
        """Cheap checks on the raw JSON object, before pydantic validates any list item."""
        for name, limit in LIST_FIELD_LIMITS.items():
            v = obj.get(name)
            if isinstance(v, (list, dict)) and len(v) > limit:
                raise APIError(f"{name}: at most {limit} items, got {len(v)}", param=name)
        prompt = obj.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return
        if isinstance(prompt[0], int) and not isinstance(prompt[0], bool):
            lists = [prompt]                        # one prompt of token ids
        else:
            self.check_num_prompts(len(prompt))
            lists = [p for p in prompt if isinstance(p, list)]
        for ids in lists:
            if len(ids) >= self.max_model_len:
                raise self.context_error(len(ids))

    def check_num_prompts(self, n: int) -> None:
        if n > self.max_prompts_per_request:
            raise APIError(f"prompt: at most {self.max_prompts_per_request} prompts per request "
                           f"(--max-prompts-per-request), got {n}", param="prompt",
                           code="too_many_prompts")
        if self.max_waiting is not None and n > self.max_waiting:
            raise APIError(f"prompt: {n} prompts can never fit in the waiting queue of "
                           f"{self.max_waiting} (--max-waiting): send fewer per request", param="prompt",
                           code="too_many_prompts")

    def context_error(self, prompt_len: int | str) -> APIError:
        return APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                        f"your prompt has {prompt_len} tokens. Please reduce the length of the prompt.",
                        param="prompt", code="context_length_exceeded")

    def check_text_fits(self, text: str) -> None:
        """400 for text that cannot fit max_model_len whatever it tokenizes to (no tokenizing)."""
        if len(text) * 4 <= self.max_prompt_bytes:      # UTF-8: at most 4 bytes a character
            return
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > self.max_prompt_bytes:
            raise self.context_error(f"at least {n // self.bytes_per_token}")


class Tokenization:
    """Tokenizer calls off the event loop: long text goes to a small thread pool (the HF
    tokenizer releases the GIL while it works), short text is done inline."""

    def __init__(self, threads: int = TOKENIZER_THREADS):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvserve-tokenize")

    async def call(self, size: int, fn, *args):
        """fn(*args): inline when `size` (characters, or token ids) is small, else on the pool."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run_many(self, fn, items: list) -> list:
        """[fn(x) for x in items] (texts to encode, or token-id lists to decode)."""
        return await self.call(sum(len(x) for x in items), lambda: [fn(x) for x in items])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
