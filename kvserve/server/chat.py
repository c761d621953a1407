"""The server's chat renderer: kvserve/chat_template.py's, with a refused conversation as HTTP 400
and, with `--escape-special-tokens-in-content`, the messages' special-token text tokenized as
plain text (kvserve/chat_escape.py).

Rendering itself (template lookup, sandbox, fallback) is shared with `LLM.chat` and
`kvserve chat` and lives in kvserve/chat_template.py.
"""
from __future__ import annotations

from kvserve.chat_escape import encode_escaped, special_token_pattern
from kvserve.chat_template import FALLBACK_CHAT_TEMPLATE, ChatTemplateError
from kvserve.chat_template import ChatRenderer as _SharedRenderer
from kvserve.server.protocol import APIError

__all__ = ["ChatRenderer", "FALLBACK_CHAT_TEMPLATE"]


class ChatRenderer(_SharedRenderer):
    def __init__(self, tokenizer, override: str | None = None, escape_special_tokens: bool = False):
        super().__init__(tokenizer, override)
        self.escape_special_tokens = escape_special_tokens
        self._special = special_token_pattern(tokenizer)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return super().render(messages, add_generation_prompt)
        except ChatTemplateError as e:
            raise _refused(e) from e

    def encode_chat(self, text: str, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """Token ids of `text`, the render of `messages`: escaped when the server escapes."""
        if not self.escape_special_tokens:
            return self.encode(text)
        try:
            return encode_escaped(self, self._special, messages, add_generation_prompt, text)
        except ChatTemplateError as e:
            raise _refused(e) from e


def _refused(e: ChatTemplateError) -> APIError:
    return APIError(f"messages: {e}", param="messages", code="chat_template_error")


def escape_special_tokens(args) -> bool:
    """`--escape-special-tokens-in-content` as given, else on exactly when tenants (`--api-keys`)
    share the server: their messages are the ones to keep out of the template's control tokens."""
    given = getattr(args, "escape_special_tokens_in_content", None)
    return bool(args.api_keys) if given is None else given
