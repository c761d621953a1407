"""The server's chat renderer: kvserve/frontend/chat_template.py's, with a refused conversation as HTTP 400
and, with `--escape-special-tokens-in-content`, the messages' special-token text tokenized as
plain text (kvserve/frontend/chat_escape.py); and a request's messages as the dicts templates read.

Rendering itself (template lookup, sandbox, fallback, tools) is shared with `LLM.chat` and
`kvserve chat` and lives in kvserve/frontend/chat_template.py.
"""
from __future__ import annotations

import json

from kvserve.frontend.chat_escape import encode_escaped, special_token_pattern
from kvserve.frontend.chat_template import FALLBACK_CHAT_TEMPLATE, RESERVED_VARIABLES, ChatTemplateError
from kvserve.frontend.chat_template import ChatRenderer as _SharedRenderer
from kvserve.server.body import note_ignored
from kvserve.server.openai.protocol import APIError

__all__ = ["ChatRenderer", "FALLBACK_CHAT_TEMPLATE", "template_messages", "request_renderer", "render_options"]

_REQUEST_TEMPLATES: dict = {}       # (tokenizer id, template text) -> ChatRenderer, the latest few
_MAX_REQUEST_TEMPLATES = 16
# A jinja comment that renders as nothing: a request's template text is never read as a file path.
_TEXT_ONLY = "{#- the request's chat_template -#}\n"


class ChatRenderer(_SharedRenderer):
    def __init__(self, tokenizer, override: str | None = None, escape_special_tokens: bool = False):
        super().__init__(tokenizer, override)
        self.escape_special_tokens = escape_special_tokens
        self._special = special_token_pattern(tokenizer)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **options) -> str:
        """`options`: continue_final_message, template_kwargs (kvserve/frontend/chat_template.py)."""
        try:
            return super().render(messages, add_generation_prompt, tools, **options)
        except ChatTemplateError as e:
            raise _refused(e) from e

    def encode_chat(self, text: str, messages: list[dict], add_generation_prompt: bool,
                    tools: list[dict] | None = None, add_special_tokens: bool | None = None,
                    **options) -> list[int]:
        """Token ids of `text`, the render of `messages` with `options`: escaped when the server
        escapes; `add_special_tokens` None: the renderer's default (kvserve/frontend/chat_template.py)."""
        if not self.escape_special_tokens:
            return self.encode(text, add_special_tokens)
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if self._special is not None and (tools or calls) and \
                self._special.search(json.dumps([tools, calls], ensure_ascii=False)):
            raise APIError("tools and tool calls may not hold special-token text (such as <|...|>) on "
                           "this server (--escape-special-tokens-in-content)", param="tools",
                           code="chat_template_error")
        try:
            return encode_escaped(self, self._special, messages, text,
                                  lambda marked: self.render(marked, add_generation_prompt, tools, **options),
                                  add_special_tokens)
        except ChatTemplateError as e:
            raise _refused(e) from e


def _refused(e: ChatTemplateError) -> APIError:
    text = str(e) if e.param != "messages" else f"messages: {e}"
    return APIError(text, param=e.param, code="chat_template_error")


def template_messages(req) -> list[dict]:
    """The request's messages as chat templates read them (Hugging Face's convention): content
    as text, an assistant's `tool_calls` with their arguments as a dict (as the model wrote
    them when they are not a JSON object), a tool message's `tool_call_id`."""
    out = []
    for m in req.messages:
        d = {"role": m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def escape_special_tokens(args) -> bool:
    """`--escape-special-tokens-in-content` as given, else on exactly when tenants (`--api-keys`)
    share the server: their messages are the ones to keep out of the template's control tokens."""
    given = getattr(args, "escape_special_tokens_in_content", None)
    return bool(args.api_keys) if given is None else given


def request_renderer(state, req):
    """The renderer of `req`: the server's, or one for vLLM's request-level `chat_template`
    (refused where the server escapes special tokens in content: the template could write
    them itself)."""
    template = getattr(req, "chat_template", None)
    if template is None:
        return state.chat
    if state.chat.escape_special_tokens:
        raise APIError("chat_template is refused on this server: it escapes special tokens in content "
                       "(--escape-special-tokens-in-content, on when tenants share it), which a request's "
                       "own template would undo", param="chat_template", code="chat_template_error")
    key = (id(state.tokenizer), template)
    renderer = _REQUEST_TEMPLATES.get(key)
    if renderer is None:
        try:
            renderer = ChatRenderer(state.tokenizer, _TEXT_ONLY + template)
        except ValueError as e:
            raise APIError(f"chat_template: {e}".replace("or pass another --chat-template", "or send another"),
                           param="chat_template", code="chat_template_error") from None
        while len(_REQUEST_TEMPLATES) >= _MAX_REQUEST_TEMPLATES:
            _REQUEST_TEMPLATES.pop(next(iter(_REQUEST_TEMPLATES)))
        _REQUEST_TEMPLATES[key] = renderer
    return renderer


def render_options(renderer, req, request=None) -> dict:
    """The render options of `req`: continue_final_message and the template's variables
    (chat_template_kwargs, and vLLM's `documents`, which a template must read). A
    chat_template_kwargs key the template never reads is left out, as vLLM does (clients send
    `enable_thinking` to every model), and named in the HTTP `request`'s ignored fields."""
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    unread = [k for k in kwargs if k not in renderer.variables and k not in RESERVED_VARIABLES]
    for k in unread:
        del kwargs[k]
    note_ignored(request, [f"chat_template_kwargs.{k}" for k in unread], "the chat template does not read them")
    documents = getattr(req, "documents", None)
    if documents is not None:
        if "documents" in kwargs:
            raise APIError("give documents once: as the documents field or in chat_template_kwargs, not both",
                           param="documents")
        if "documents" not in renderer.variables:
            raise APIError("documents: this chat template does not read a documents variable, so they would "
                           "not reach the prompt (use a template that does, or put them in the messages)",
                           param="documents", code="chat_template_error")
        kwargs["documents"] = documents
    return {"continue_final_message": req.continue_final_message, "template_kwargs": kwargs or None}
