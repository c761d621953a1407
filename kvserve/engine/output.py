"""Output processing: incremental detokenization and stop conditions (EOS, stop tokens, stop
strings, max_tokens, max_model_len).

Detokenization decodes a short window of tokens twice, with and without the newest one, and
emits the difference only once it no longer ends in U+FFFD: a character split over several
byte-fallback tokens is never streamed half-made. Text that might be the start of a stop string
is held back until it is decided, so streamed text never has to be taken back.
"""
from __future__ import annotations

from kvserve.engine.request import Request, RequestStatus
from kvserve.model.tokenizer import Tokenizer

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


class OutputProcessor:
    """Per sequence: detokenize the new token and decide whether the sequence is finished."""

    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.detok: dict[str, IncrementalDetokenizer] = {}

    def start(self, req: Request) -> None:
        self.detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)

    def drop(self, req: Request) -> None:
        self.detok.pop(req.request_id, None)

    def text(self, req: Request) -> str:
        """The text the user may see now (stop-string prefixes held back while running)."""
        d = self.detok[req.request_id]
        if req.is_finished or not req.params.stop_strings:
            return d.text
        return d.text[:len(d.text) - held_back(d.text, req.params.stop_strings)]

    def process_token(self, req: Request, token_id: int) -> RequestStatus | None:
        """Record the sampled token (already appended to req.token_ids); return a finished
        status or None."""
        p = req.params
        d = self.detok[req.request_id]
        old_len = len(d.text)
        d.add(token_id)
        n_out = req.num_output_tokens
        if n_out >= p.min_tokens:
            if token_id == req.eos_token_id and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in p.stop_token_id_set:         # O(1) however many ids
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            for s in p.stop_strings:
                at = d.text.find(s, max(0, old_len - len(s) + 1))
                if at >= 0:
                    d.text = d.text[:at + len(s)] if p.include_stop_str_in_output else d.text[:at]
                    req.stop_reason = s
                    return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
