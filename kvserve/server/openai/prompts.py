"""The engine prompts behind one HTTP request, and the bounds they are checked against first.

`prompt_items` turns a /v1/completions request into engine prompts: the prompt count is checked
here, and the frontend (frontend/tokenization.py) bounds each text's UTF-8 size and tokenizes it
off the event loop. `max_tokens_for` is the frontend's context-window rule, refused as an HTTP 400.
"""
from __future__ import annotations

import re
import uuid

from kvserve.frontend.processor import ContextLengthError, context_max_tokens, truncated
from kvserve.server.limits import context_error
from kvserve.server.openai.protocol import APIError, CompletionRequest

REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,256}$")


def request_ids(prefix: str, req, request) -> tuple[str, str, dict]:
    """(the response id, the prefix of its engine requests' ids, the response's headers). The
    client's id -- an X-Request-Id header, else vLLM's `request_id` field -- is the response id's
    suffix, as in vLLM, and is echoed as X-Request-Id; its engine requests (named in the request
    log) add a suffix of their own, so two requests sharing an id never collide in the engine."""
    given = request.headers.get(REQUEST_ID_HEADER) if request is not None else None
    if given is not None and not _REQUEST_ID.match(given):
        raise APIError(f"the {REQUEST_ID_HEADER} header must be 1 to 256 characters of A-Z a-z 0-9 . _ : -",
                       param=REQUEST_ID_HEADER)
    given = given or getattr(req, "request_id", None)
    if given is None:
        rid = f"{prefix}-{uuid.uuid4().hex}"
        return rid, rid, {}
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}", {REQUEST_ID_HEADER: given}


def engine_salt(req) -> str | None:
    """The request's cache salt; with llama-server's `cache_prompt: false`, one of its own, so
    its prompt neither reuses nor leaves shareable prefix-cache blocks."""
    salt = getattr(req, "cache_salt", None)
    if getattr(req, "cache_prompt", True):
        return salt
    return f"{salt or ''}\x00uncached-{uuid.uuid4().hex}"


def truncate_prompt(state, req, ids: list[int]) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: max_model_len)."""
    k = getattr(req, "truncate_prompt_tokens", None)
    limit = state.engine.limits.max_model_len
    if k is not None and k > limit:
        raise APIError(f"truncate_prompt_tokens ({k}) must not exceed max_model_len ({limit})",
                       param="truncate_prompt_tokens", code="context_length_exceeded")
    return truncated(ids, k, limit)


def max_tokens_for(state, prompt_len: int, requested: int | None, min_tokens: int = 0) -> int:
    """The request's max_tokens under the frontend's context-window rule
    (frontend/processor.py's `context_max_tokens`), its refusal as OpenAI's 400."""
    try:
        return context_max_tokens(state.engine.limits, prompt_len, requested, min_tokens)
    except ContextLengthError as e:
        raise context_error(e) from None


def split_prompts(p) -> list[str | list[int]]:
    """A completions `prompt` as a list of single prompts (text or token ids)."""
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [list(p)]            # one prompt given as token ids
    return list(p)                  # list of strings, or list of token-id lists


async def prompt_items(state, req: CompletionRequest) -> list[dict]:
    """The engine prompt of each prompt of the request, tokenized off the event loop after a
    check that needs no tokenizing (server/limits.py)."""
    prompts = split_prompts(req.prompt)
    state.limits.check_num_prompts(len(prompts))
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and state.tokenizer is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    try:
        encoded = iter(await state.tokenization.encode(texts, req.add_special_tokens) if texts else ())
    except ContextLengthError as e:
        raise context_error(e) from None
    items = []
    salt = engine_salt(req)
    for p in prompts:
        ids = next(encoded) if isinstance(p, str) else p
        kept = truncate_prompt(state, req, ids)
        item = {"prompt_token_ids": kept, "prompt": p} if isinstance(p, str) and kept is ids else {"prompt_token_ids": kept}
        if salt is not None:
            item["cache_salt"] = salt
        items.append(item)
    return items


async def echo_texts(state, req: CompletionRequest, items: list[dict]) -> list[str]:
    """With echo, each prompt's text (token-id prompts decoded off the event loop)."""
    if not req.echo:
        return [""] * len(items)
    tok = state.tokenizer
    id_prompts = [it["prompt_token_ids"] for it in items if "prompt" not in it]
    decoded = iter(await state.tokenization.run_many(tok.decode, id_prompts)
                   if tok is not None and id_prompts else ())
    return [it["prompt"] if "prompt" in it else (next(decoded) if tok is not None else "")
            for it in items]
