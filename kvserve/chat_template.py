"""Rendering chat messages into a prompt: the model's chat template, or a documented fallback.

The template comes from, in order: `--chat-template FILE` (a jinja2 file, or the template text
itself), the tokenizer's `chat_template` (from `tokenizer_config.json`), or the fallback below.
Templates run in jinja2's sandbox with the variables and helpers Hugging Face templates expect:
`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
`strftime_now` and the `tojson` filter.

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
    """The template refused the conversation; the message says what it objected to."""


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
            # A template written for tools reads the `tools` variable (and so its tool calls).
            self.accepts_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template does not parse ({e}): fix it, or pass another "
                             "--chat-template.") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The prompt text; ChatTemplateError (a ValueError) if the template refuses the messages."""
        extra = {}
        if self.accepts_tools:
            extra["tools"] = tools or None
        elif tools or any(m.get("tool_calls") for m in messages):
            messages = with_tool_prompt(messages, tools)
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=getattr(self.tokenizer, "bos_token", None) or "",
                eos_token=getattr(self.tokenizer, "eos_token", None) or "", **extra)
        except jinja2.TemplateError as e:
            # Templates reject conversations they cannot format (e.g. roles not alternating).
            raise ChatTemplateError(f"the chat template rejected the conversation ({e}): change the "
                                    "messages to a form it accepts (most want alternating user and "
                                    "assistant turns).") from e

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (BOS added only for the fallback, see the module doc)."""
        return self.tokenizer.encode(text, add_special_tokens=self.is_fallback)


def _model_template(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    elif isinstance(t, list):        # [{"name": ..., "template": ...}] form
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t or None
