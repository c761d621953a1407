"""`tool_choice="auto"`: the model's text read as it streams, with one `ToolParser`.

Content goes out as soon as it cannot begin a tool call (a possible start of the parser's
marker is held back, and so is trailing whitespace, which is dropped when calls follow). From
the marker on, text is held and re-read each step; a call goes out, id and name and arguments
in one piece, once it is complete and names a known function. At the end the section's text
that held no call is content. A non-streamed answer is the same updates folded (base.assemble),
so both agree exactly."""
from __future__ import annotations

from kvserve.tool_calls.base import CallDelta, ToolParser, Update, call_id


class AutoCalls:
    def __init__(self, parser: ToolParser, names, max_calls: int | None = None):
        self.parser = parser
        self.names = frozenset(names)
        self.max_calls = max_calls          # parallel_tool_calls=false: 1
        self.text = ""
        self.sent = 0                       # text[:sent] is out (as content, or held whitespace)
        self.held_space = ""
        self.section: int | None = None     # where the tool-call section starts
        self.num_calls = 0

    def feed(self, delta: str) -> Update:
        self.text += delta
        out = Update()
        if self.section is None:
            n, found = self.parser.content_until(self.text[self.sent:], self.sent == 0)
            out = self._content(self.text[self.sent:self.sent + n])
            self.sent += n
            if not found:
                return out
            self.section = self.sent
        return out.extend(self._calls(final=False)[0])

    def finish(self) -> Update:
        held, self.held_space = self.held_space, ""
        if self.section is None:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return Update(held + rest)
        out, leftover = self._calls(final=True)
        if self.num_calls == 0:
            out.content = held + leftover
        elif leftover.strip():
            out.content = leftover
        return out

    def _content(self, text: str) -> Update:
        """`text` as content, its trailing whitespace held until something follows it."""
        text = self.held_space + text
        body = text.rstrip()
        self.held_space = text[len(body):]
        return Update(body)

    def _calls(self, final: bool) -> tuple[Update, str]:
        calls, leftover = self.parser.parse_section(self.text[self.section:], self.names, final)
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        out = Update()
        for name, arguments in calls[self.num_calls:]:
            out.calls.append(CallDelta(self.num_calls, arguments, call_id(self.parser.id_kind), name))
            self.num_calls += 1
        return out, leftover
