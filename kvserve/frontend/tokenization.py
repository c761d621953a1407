"""A server's tokenizing, owned by the frontend (beside the Processor, which checks what comes
back): the tokenizer's calls off the event loop, and the one bound a text meets before it is
tokenized.

- A text longer in UTF-8 bytes than `max_model_len` times the most bytes any one token stands
  for cannot fit, and is refused before it is tokenized (`check_text_fits`: a
  `ContextLengthError`, which the server answers as OpenAI's 400 context_length_exceeded).
- What is tokenized (or detokenized) is done on a small worker pool, not on the event loop, so a
  long prompt never stalls `/health` or another client's stream (`call`, `run_many`, `encode`);
  short text is done inline (microseconds).
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from kvserve.frontend.processor import ContextLengthError

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 2048    # shorter text is tokenized on the event loop
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
    if tokenizer is None:
        return MIN_BYTES_PER_TOKEN_BOUND
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


class Tokenization:
    """The tokenizer of one served model, called off the event loop, with the bound above."""

    def __init__(self, tokenizer, max_model_len: int, threads: int = TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bytes_per_token = max_bytes_per_token(tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvserve-tokenize")

    @property
    def max_prompt_bytes(self) -> int:
        return self.max_model_len * self.bytes_per_token

    def check_text_fits(self, text: str, param: str = "prompt") -> None:
        """ContextLengthError for text that cannot fit max_model_len whatever it tokenizes to
        (no tokenizing)."""
        if len(text) * 4 <= self.max_prompt_bytes:      # UTF-8: at most 4 bytes a character
            return
        n = len(text.encode("utf-8", "surrogatepass"))
        if n > self.max_prompt_bytes:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"{param} has at least {n // self.bytes_per_token} tokens. Please reduce the length of "
                f"the {param}.", param)

    async def call(self, size: int, fn, *args):
        """fn(*args): inline when `size` (characters, or token ids) is small, else on the pool."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def run_many(self, fn, items: list) -> list:
        """[fn(x) for x in items] (texts to encode, or token-id lists to decode)."""
        return await self.call(sum(len(x) for x in items), lambda: [fn(x) for x in items])

    async def encode(self, texts: list[str], add_special_tokens: bool = True, param: str = "prompt") -> list[list[int]]:
        """Each text's token ids, each checked against the bound first."""
        for t in texts:
            self.check_text_fits(t, param)
        tok = self.tokenizer
        return await self.run_many(lambda t: tok.encode(t, add_special_tokens=add_special_tokens), texts)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
