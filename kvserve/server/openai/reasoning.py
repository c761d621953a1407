"""`--reasoning-parser`: a reasoning model's `<think>...</think>` text apart from its answer.

    deepseek_r1   the chat template opens the thought (`...<think>\\n` ends the prompt): the answer
                  is what follows the first `</think>`; until one comes, everything is reasoning
    qwen3         a thought is there only when the output opens with `<think>` (Qwen3 with
                  `enable_thinking: false` answers at once); it runs to the first `</think>`

A `ReasoningSplitter` reads one choice's text as it streams and returns each piece's
(reasoning, content); the whole answer is the same splitter fed once, so a stream's deltas and
the answer agree. An opening `<think>` the model writes itself is dropped, and so is the
whitespace between `</think>` and the answer. A marker split across deltas is held back until
it is known. Structured outputs apply to the answer only: the constraint's grammar is preceded
by the thought's (structured/reasoning_grammar.py).
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_in_thought: bool          # the prompt ends inside the thought (DeepSeek-R1's template)


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True),
                     "qwen3": ReasoningParser("qwen3", False)}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


def _held(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker` (held back until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's text in pieces -> (reasoning, content) per piece. States: "start" (before
    the first character: is there a thought?), "thought", "gap" (whitespace after `</think>`),
    "answer"."""

    def __init__(self, parser: ReasoningParser):
        self.state = "thought" if parser.opens_in_thought else "start"
        self.opening = True             # in a thought, an opening <think> may still come
        self.pending = ""
        self.had_thought = parser.opens_in_thought

    @property
    def thought_open(self) -> bool:
        """True while the text may still be (or become) thought: the thought has not ended."""
        return self.state in ("start", "thought")

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.pending + text, last=False)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text is complete."""
        return self._split(self.pending, last=True)

    def _split(self, text: str, last: bool) -> tuple[str, str]:
        self.pending = ""
        reasoning, content = [], []
        while text:
            if self.state == "start":
                if THINK_START.startswith(text) and not last:
                    self.pending = text             # "<thi": a thought, or an answer?
                    break
                if text.startswith(THINK_START):
                    self.state, self.opening, self.had_thought = "thought", False, True
                    text = text[len(THINK_START):]
                else:
                    self.state = "answer"
            elif self.state == "thought":
                if self.opening:
                    if THINK_START.startswith(text) and not last:
                        self.pending = text
                        break
                    self.opening = False
                    if text.startswith(THINK_START):
                        text = text[len(THINK_START):]
                        continue
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning.append(text[:end])
                    self.state, text = "gap", text[end + len(THINK_END):]
                    continue
                keep = 0 if last else _held(text, THINK_END)
                reasoning.append(text[:len(text) - keep])
                self.pending = text[len(text) - keep:]
                break
            elif self.state == "gap":
                rest = text.lstrip()
                if not rest:
                    break                           # only whitespace so far: nothing to say yet
                self.state, text = "answer", rest
            else:
                content.append(text)
                break
        return "".join(reasoning), "".join(content)


def thought_token_count(ids: list[int], decode) -> int:
    """How many of `ids` (an answer's first tokens, its thought's end among them) belong to the
    thought, markers included: the fewest leading tokens whose text holds `</think>` (a binary
    search over `decode`d prefixes; the text of a longer prefix holds a shorter one's)."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return hi
