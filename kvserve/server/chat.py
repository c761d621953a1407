"""The server's chat renderer: kvserve/chat_template.py's, with a refused conversation as HTTP 400.

Rendering itself (template lookup, sandbox, fallback) is shared with `LLM.chat` and
`kvserve chat` and lives in kvserve/chat_template.py.
"""
from __future__ import annotations

from kvserve.chat_template import FALLBACK_CHAT_TEMPLATE, ChatTemplateError
from kvserve.chat_template import ChatRenderer as _SharedRenderer
from kvserve.server.protocol import APIError

__all__ = ["ChatRenderer", "FALLBACK_CHAT_TEMPLATE"]


class ChatRenderer(_SharedRenderer):
    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return super().render(messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise APIError(f"messages: {e}", param="messages") from e
