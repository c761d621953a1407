"""One choice's text as OpenAI's assistant message: plain content, or content and tool calls as
a reader (server/openai/tool_choice.py) finds them. A stream's deltas and a whole answer are the same
reader's updates, so both say the same; a choice that made calls and stopped finishes with
`"tool_calls"`. Where the server kept special tokens for the reader (a parser's markers may be
special tokens), the text of the special token that stopped the choice (`<|im_end|>`) is left
out, as it is when they are skipped: `stop_text(token_id)` gives it."""
from __future__ import annotations

from kvserve.server.openai.protocol import ChatMessage, DeltaMessage
from kvserve.server.openai.reasoning import ReasoningSplitter, thought_token_count
from kvserve.server.openai.tool_fields import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvserve.tool_calls.base import Update, assemble


class ChoiceOutput:
    """`reasoning`: the server's --reasoning-parser (server/openai/reasoning.py), or None: its
    thought becomes `reasoning_content`, and the reader sees only the answer after it."""

    def __init__(self, reader=None, stop_text=None, reasoning=None, decode=None):
        self.reader = reader
        self.stop_text = stop_text
        self.splitter = ReasoningSplitter(reasoning) if reasoning is not None else None
        self.made_calls = False
        # the thought's tokens (usage's reasoning_tokens): counted once the thought ends, from the
        # token ids seen until then, with `decode` (token ids -> text, special tokens kept)
        self.decode = decode
        self.reasoning_tokens = 0
        self._open_ids: list[int] | None = [] if reasoning is not None else None

    def delta(self, text: str, finish_reason: str | None, token_ids=()) -> tuple[DeltaMessage, str | None]:
        """The delta of one step's text (the last step's: with the reader's rest)."""
        text = self._without_stop(text, finish_reason, token_ids)
        thought, text = self._split(text, finish_reason is not None, token_ids)
        if self.reader is None:
            if self.splitter is None:
                return DeltaMessage(content=text), finish_reason
            return DeltaMessage(content=text or None, reasoning_content=thought or None), finish_reason
        u = self._update(text, finish_reason is not None)
        calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                               function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
                 for d in u.calls]
        return DeltaMessage(content=u.content or None, reasoning_content=thought or None,
                            tool_calls=calls or None), self._finish(finish_reason)

    def message(self, text: str, finish_reason: str | None, token_ids=()) -> tuple[ChatMessage, str | None]:
        """The whole answer's message."""
        text = self._without_stop(text, finish_reason, token_ids)
        thought, text = self._split(text, True, token_ids)
        if self.reader is None:
            if self.splitter is None:
                return ChatMessage(content=text), finish_reason
            return ChatMessage(content=text or None, reasoning_content=thought or None), finish_reason
        content, calls = assemble([self._update(text, True)])
        return ChatMessage(content=content or None, reasoning_content=thought or None, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
        ] or None), self._finish(finish_reason)

    def _split(self, text: str, last: bool, token_ids=()) -> tuple[str, str]:
        """(thought, answer) of a piece of text (of `token_ids`); ("", text) without a reasoning parser."""
        if self.splitter is None:
            return "", text
        thought, answer = self.splitter.feed(text)
        if last:
            more_thought, more_answer = self.splitter.finish()
            thought, answer = thought + more_thought, answer + more_answer
        self._count_thought(token_ids, last)
        return thought, answer

    def _count_thought(self, token_ids, last: bool) -> None:
        if self._open_ids is None:
            return
        self._open_ids.extend(token_ids)
        s = self.splitter
        if s.thought_open and not last:
            return
        ids, self._open_ids = self._open_ids, None
        if not s.had_thought:
            self.reasoning_tokens = 0
        elif s.thought_open:                      # it never ended: every token is thought
            self.reasoning_tokens = len(ids)
        else:
            self.reasoning_tokens = thought_token_count(ids, self.decode)

    def _without_stop(self, text: str, finish_reason: str | None, token_ids) -> str:
        if finish_reason == "stop" and token_ids and self.stop_text is not None:
            end = self.stop_text(token_ids[-1])
            if end and text.endswith(end):
                return text[:-len(end)]
        return text

    def _update(self, text: str, last: bool) -> Update:
        u = self.reader.feed(text)
        if last:
            u.extend(self.reader.finish())
        self.made_calls = self.made_calls or bool(u.calls)
        return u

    def _finish(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.made_calls else finish_reason
