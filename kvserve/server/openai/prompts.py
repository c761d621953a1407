"""The engine prompts behind one HTTP request, and the bounds they are checked against first.

`prompt_items` turns a /v1/completions request into engine prompts: the prompt count
and each text's UTF-8 size are checked before anything is tokenized, and tokenizing runs off the
event loop. `max_tokens_for` is the frontend's context-window rule, refused as an HTTP 400.
"""
from __future__ import annotations

from kvserve.frontend.processor import ContextLengthError, context_max_tokens
from kvserve.server.openai.protocol import APIError, CompletionRequest


def max_tokens_for(state, prompt_len: int, requested: int | None, min_tokens: int = 0) -> int:
    """The request's max_tokens under the frontend's context-window rule
    (frontend/processor.py's `context_max_tokens`), its refusal as OpenAI's 400."""
    try:
        return context_max_tokens(state.engine.limits, prompt_len, requested, min_tokens)
    except ContextLengthError as e:
        raise APIError(str(e), param=e.param, code="context_length_exceeded") from None


async def prompt_items(state, req: CompletionRequest) -> list[dict]:
    """The engine prompt of each prompt of the request, tokenized off the event loop after a
    check that needs no tokenizing (server/limits.py)."""
    tok = state.tokenizer
    prompts = req.prompts()
    state.limits.check_num_prompts(len(prompts))
    texts = [p for p in prompts if isinstance(p, str)]
    if texts and tok is None:
        raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    for t in texts:
        state.limits.check_text_fits(t)
    encode = lambda t: tok.encode(t, add_special_tokens=req.add_special_tokens)   # noqa: E731
    encoded = iter(await state.tokenization.run_many(encode, texts) if texts else ())
    items = []
    for p in prompts:
        if isinstance(p, str):
            item = {"prompt_token_ids": next(encoded), "prompt": p}
        else:
            item = {"prompt_token_ids": p}
        if req.cache_salt is not None:
            item["cache_salt"] = req.cache_salt
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
