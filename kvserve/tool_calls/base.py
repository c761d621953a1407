"""What every tool-call reader shares: the pieces a stream of model text turns into, call ids,
and the check that makes a parsed object a call.

A reader is fed the model's text as it comes and answers with an `Update`: the content text it
is sure of and the `CallDelta`s it found (a call's id and name first, then its arguments as
fragments). `assemble` folds updates into the final message, so a non-streamed answer is the
same fold of the same updates a stream sends.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field


@dataclass
class CallDelta:
    """A piece of call `index`: its id and name (the first piece only), then argument text."""
    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class Update:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: "Update") -> "Update":
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str          # JSON text of the arguments object


def call_id(kind: str = "openai") -> str:
    """A fresh call id: OpenAI's `call_` + 24 hex digits, or Mistral's 9 letters and digits
    (its chat templates refuse any other)."""
    if kind == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


def assemble(updates) -> tuple[str, list[ToolCall]]:
    """The content and the calls that a sequence of updates adds up to."""
    content, calls = "", {}
    for u in updates:
        content += u.content
        for d in u.calls:
            c = calls.setdefault(d.index, ToolCall(d.id or "", d.name or "", ""))
            c.id = d.id or c.id
            c.name = d.name or c.name
            c.arguments += d.arguments
    return content, [calls[i] for i in sorted(calls)]


def call_from_object(obj, names: frozenset[str], args_keys=("arguments", "parameters")) -> tuple[str, str] | None:
    """(name, arguments JSON) when `obj` is {"name": one of `names`, "arguments": {...}}
    (the key may be any of `args_keys`; a JSON string holding an object counts; none: {}),
    else None: the model wrote something that is not a call of a known function."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def held_marker_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could begin `marker` (to hold back in a stream)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser:
    """How one model family writes tool calls in its text (vLLM's `--tool-call-parser` names).

    `content_until(text, at_start)`: (n, found): `text[:n]` is plain content; when `found`,
    the tool-call section starts at n, else `text[n:]` is held back (it could begin one).
    `at_start`: `text` begins the output. `parse_section(section, names, final)`: the calls the
    section holds, as (name, arguments JSON), and its text that is not a call; before `final`,
    only calls already complete (which the final parse returns first, in order)."""
    name = ""
    id_kind = "openai"
    marker = ""

    def content_until(self, text: str, at_start: bool) -> tuple[int, bool]:
        i = text.find(self.marker)
        if i >= 0:
            return i, True
        return len(text) - held_marker_prefix(text, self.marker), False

    def parse_section(self, section: str, names: frozenset[str], final: bool
                      ) -> tuple[list[tuple[str, str]], str]:
        raise NotImplementedError


def decode_objects(text: str, pos: int, separators: str) -> tuple[list[tuple[object, int]], int]:
    """JSON values from `text[pos:]`, one after another, skipping whitespace and any of
    `separators` between them: ([(value, where it starts)], where the undecodable rest starts)."""
    decoder = json.JSONDecoder()
    values = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text):
            return values, pos
        try:
            value, end = decoder.raw_decode(text, pos)
        except ValueError:
            return values, pos
        values.append((value, pos))
        pos = end
