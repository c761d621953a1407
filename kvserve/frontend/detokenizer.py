"""Incremental detokenization and the stop-string hold-back (the frontend's text work).

Detokenization decodes a short window of tokens twice, with and without the newest one, and
emits the difference only once it no longer ends in U+FFFD: a character split over several
byte-fallback tokens is never streamed half-made. Text that might be the start of a stop string
is held back until it is decided, so streamed text never has to be taken back.
"""
from __future__ import annotations

from kvserve.model.tokenizers.tokenizer import Tokenizer

CONTEXT_TOKENS = 6  # prompt tokens kept as the window's left context (leading spaces, merges)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.tokens.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.tokens[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.tokens[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += new
            return new
        return ""


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
