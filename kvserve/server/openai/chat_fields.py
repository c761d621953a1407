"""The chat request's prompt-shaping fields (shared with /tokenize, which renders a chat the same
way) and OpenAI's chat fields kvserve cannot honour, each refused with a 400 rather than ignored.

    add_generation_prompt    open the assistant's turn (default true)
    continue_final_message   the last message stays open: the model goes on writing it (needs
                             add_generation_prompt false, vLLM's rule)
    chat_template_kwargs     more variables for the chat template (Qwen3's `enable_thinking`);
                             a key the template never reads is refused (kvserve/frontend/chat_template.py)
    add_special_tokens       None: BOS only where the template writes none; true / false: as said
    chat_template            vLLM's: this request's template (its text) instead of the model's;
                             refused where the server escapes special tokens in content (tenants
                             share it): a request's template could write them itself
    documents                vLLM's: the template's `documents` variable (RAG templates); refused
                             when the template never reads it

    functions, function_call, audio, modalities (other than ["text"]), prediction,
    web_search_options, reasoning_effort: only null (`REFUSED` says why, server/body.py)
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from kvserve.server.openai.extension_fields import REFUSED_EXTENSIONS
from kvserve.server.openai.request_rules import Implies
from kvserve.server.openai.wire_types import Strict, Text

MAX_TEMPLATE_KWARGS = 64
MAX_DOCUMENTS = 256
MAX_CHAT_TEMPLATE_CHARS = 256 * 1024
CONTINUE_RULE = Implies("continue_final_message", {"const": True}, "add_generation_prompt", False,
                        "continue_final_message and add_generation_prompt cannot both be true: set "
                        "add_generation_prompt to false to continue the last message")


class ChatTemplateFields(Strict):
    """(A model using these states CONTINUE_RULE among its rules.)"""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    add_special_tokens: Optional[bool] = None
    chat_template: Optional[Text] = Field(None, min_length=1, max_length=MAX_CHAT_TEMPLATE_CHARS)
    documents: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_DOCUMENTS)


class RefusedChatFields(Strict):
    """OpenAI's chat fields that ask for what kvserve does not do: only null is accepted."""
    functions: None = None
    function_call: None = None
    audio: None = None
    modalities: Optional[list[Literal["text"]]] = None
    prediction: None = None
    web_search_options: None = None
    reasoning_effort: None = None


REFUSED = {
    "functions": "functions is not supported (it is the deprecated form of tools: use tools)",
    "function_call": "function_call is not supported (the deprecated form of tool_choice: use tool_choice)",
    "audio": "audio output is not supported (this server writes text)",
    "modalities": "modalities other than [\"text\"] are not supported",
    "prediction": "prediction (predicted outputs) is not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported: the served model has no reasoning modes "
                        "kvserve can select",
    **REFUSED_EXTENSIONS,       # (both endpoints': server/body.py reads this table for every request)
}
