"""Rendering chat messages into a prompt: the model's chat template, or a documented fallback.

The template comes from, in order: `--chat-template FILE` (a jinja2 file, or the template text
itself), the tokenizer's `chat_template` (from `tokenizer_config.json`), or the fallback below.
Templates run in jinja2's sandbox with the variables and helpers Hugging Face templates expect:
`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
`strftime_now` and the `tojson` filter.

`continue_final_message` (Hugging Face's) leaves the last message open for the model to go on
writing: the render is cut right after that message's text, and no generation prompt follows.
`template_kwargs` (vLLM's `chat_template_kwargs`) are more variables for the template, such as
Qwen3's `enable_thinking`; one the template never reads, or one the renderer itself sets, is
refused, so no keyword is silently without effect (the server leaves out the unread ones before
this, naming them in its ignored-fields header, as vLLM ignores them).

Tools (`render(..., tools=[{"type": "function", "function": {...}}])`) reach a template that
reads a `tools` variable through it, with the history's tool calls as Hugging Face passes them
(`message.tool_calls[i].function.arguments` a dict); any other template gets kvserve's default
tool prompt and the calls written into the messages' content (kvserve/tool_calls/prompt.py).

The fallback, for base models without a template (such as stories260K), is plain text, one
line per message, and an open `Assistant:` turn:

    System: You are terse.
    User: Tell me a story.
    Assistant:

A model's own template is expected to write any BOS token itself (Hugging Face convention), so
its output is tokenized without special tokens; the fallback is tokenized with them (BOS first).
"""
from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.tool_calls.prompt import with_tool_prompt

FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template refused the conversation or an option; the message says what it objected
    to, `param` which request field it was about."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


class ChatRenderer:
    """Messages -> prompt text -> token ids, for one tokenizer (and an optional override)."""

    def __init__(self, tokenizer, override: str | None = None):
        self.tokenizer = tokenizer
        template = None
        self.is_fallback = False
        if override:
            if os.path.isfile(override):
                with open(override, encoding="utf-8") as f:
                    template = f.read()
            else:
                template = override
        if template is None:
            template = _model_template(tokenizer)
        if template is None:
            template = FALLBACK_CHAT_TEMPLATE
            self.is_fallback = True
        self.source = template
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(template)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
            # A template written for tools reads the `tools` variable (and so its tool calls).
            self.accepts_tools = "tools" in self.variables
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not parse ({e}): fix it, or pass another "
                             "--chat-template.") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, *, continue_final_message: bool = False,
               template_kwargs: dict | None = None) -> str:
        """The prompt text; ChatTemplateError (a ValueError) if the template refuses the messages
        or the options (module docstring)."""
        extra = self._template_kwargs(template_kwargs)
        if continue_final_message:
            if add_generation_prompt:
                raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be "
                                        "true: set add_generation_prompt to false to continue the last message",
                                        "continue_final_message")
            if not messages or not messages[-1].get("content"):
                raise ChatTemplateError("continue_final_message needs a last message with text to continue",
                                        "continue_final_message")
        if self.accepts_tools:
            extra["tools"] = tools or None
        elif tools or any(m.get("tool_calls") for m in messages):
            messages = with_tool_prompt(messages, tools)
        try:
            text = self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=getattr(self.tokenizer, "bos_token", None) or "",
                eos_token=getattr(self.tokenizer, "eos_token", None) or "", **extra)
        except jinja2.TemplateError as e:
            # Templates reject conversations they cannot format (e.g. roles not alternating).
            raise ChatTemplateError(f"the chat template rejected the conversation ({e}): change the "
                                    "messages to a form it accepts (most want alternating user and "
                                    "assistant turns).") from e
        return _cut_after_last(text, messages[-1]["content"]) if continue_final_message else text

    def _template_kwargs(self, kwargs: dict | None) -> dict:
        kwargs = dict(kwargs or {})
        reserved = sorted(k for k in kwargs if k in RESERVED_VARIABLES)
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {reserved}: the request's own fields "
                                    "(messages, tools, add_generation_prompt) and the tokenizer set them",
                                    "chat_template_kwargs")
        unread = sorted(k for k in kwargs if k not in self.variables)
        if unread:
            raise ChatTemplateError(f"chat_template_kwargs {unread} are not read by this model's chat "
                                    f"template (it reads {sorted(self.variables - RESERVED_VARIABLES)})",
                                    "chat_template_kwargs")
        return kwargs

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of rendered text. By default BOS is added only for the fallback (see the
        module doc); `add_special_tokens` (the request's) overrides that."""
        special = self.is_fallback if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(text, add_special_tokens=special)


RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                 "raise_exception", "strftime_now"})


def _cut_after_last(text: str, final: str) -> str:
    """`text` up to the end of the last occurrence of the final message's text (stripped, as
    templates that trim messages write it): what comes after closes the turn."""
    for needle in (final, final.strip()):
        at = text.rfind(needle) if needle else -1
        if at >= 0:
            return text[:at + len(needle)]
    raise ChatTemplateError("continue_final_message: the chat template does not write the last message's "
                            "text as given, so it cannot be continued", "continue_final_message")


def _model_template(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    elif isinstance(t, list):        # [{"name": ..., "template": ...}] form
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t or None
