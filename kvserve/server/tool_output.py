"""One choice's text as OpenAI's assistant message: plain content, or content and tool calls as
a reader (server/tool_choice.py) finds them. A stream's deltas and a whole answer are the same
reader's updates, so both say the same; a choice that made calls and stopped finishes with
`"tool_calls"`."""
from __future__ import annotations

from kvserve.server.protocol import ChatMessage, DeltaMessage
from kvserve.server.tool_fields import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvserve.tool_calls.base import Update, assemble


class ChoiceOutput:
    def __init__(self, reader=None):
        self.reader = reader
        self.made_calls = False

    def delta(self, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
        """The delta of one step's text (the last step's: with the reader's rest)."""
        if self.reader is None:
            return DeltaMessage(content=text), finish_reason
        u = self._update(text, finish_reason is not None)
        calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                               function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                 for d in u.calls]
        return DeltaMessage(content=u.content or None, tool_calls=calls or None), self._finish(finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The whole answer's message."""
        if self.reader is None:
            return ChatMessage(content=text), finish_reason
        content, calls = assemble([self._update(text, True)])
        return ChatMessage(content=content or None, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
        ] or None), self._finish(finish_reason)

    def _update(self, text: str, last: bool) -> Update:
        u = self.reader.feed(text)
        if last:
            u.extend(self.reader.finish())
        self.made_calls = self.made_calls or bool(u.calls)
        return u

    def _finish(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.made_calls else finish_reason
