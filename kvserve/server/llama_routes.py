"""llama-server's native routes, over the server's one completion path.

    POST /completion      (and /completions) llama-server's completion API: `prompt` (text or token ids), its
                          sampling fields, `stream` (SSE `data: {"content", "stop", ...}` chunks,
                          no [DONE]); answers {"content", "tokens_predicted", "tokens_evaluated",
                          "stop", "stop_type", "stopping_word", "tokens_cached", "truncated",
                          "model", "generation_settings", "timings", ...}
    POST /infill          fill in the middle: `input_prefix`, `input_suffix` and `prompt` (the
                          middle's start) around the tokenizer's FIM tokens, then as /completion
    GET  /props           default_generation_settings, total_slots (max_num_seqs), model_path,
                          chat_template, bos/eos tokens, n_ctx
    GET  /slots           one entry per seat of the engine (max_num_seqs): id, n_ctx, is_processing
    GET|POST /ping        vLLM's liveness route, answered as /health

A /completion body becomes a `CompletionRequest` and runs through server/openai/prompts.py
(bounds, tokenizing), sampling.py (`SamplingParams`) and submission.py, as /v1/completions does;
only the answer's shape is llama-server's. Fields are llama-server's names:

    n_predict -> max_tokens (-1: up to the context; the default: -n, else -1), temperature, top_k
    (0: off), top_p, min_p, seed (-1: random), stop, ignore_eos, logit_bias ({"id": bias} or
    [[id, bias], ...]), n_probs -> logprobs (answered as llama-server's completion_probabilities),
    repeat_penalty -> repetition_penalty (over the whole context, so only with repeat_last_n -1),
    grammar / json_schema (server/openai/structured_fields.py), return_tokens, cache_prompt
    (true: may share prefix-cache blocks when the server's prefix cache is on; false: a fresh
    cache salt, so it shares none), id_slot (-1 only: kvserve does not pin requests to seats).

Sampling defaults are llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05),
under --generation-config's; /props shows them. The fields kvserve does not build are refused
naming them (server/llama_fields.py).
"""
from __future__ import annotations

import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from kvserve.config.cli_args import kvserve_version
from kvserve.frontend.processor import ContextLengthError
from kvserve.server.body import parse_body, validation_error_to_api_error
from kvserve.server.limits import context_error
from kvserve.server.llama_fields import (
    LLAMA_DEFAULTS, LlamaCompletionRequest, LlamaCompletionResponse, LlamaInfillRequest, PropsResponse,
    SlotsResponse)
from kvserve.server.openai.logprobs import logprob_entries
from kvserve.server.openai.prompts import max_tokens_for, prompt_items
from kvserve.server.openai.protocol import APIError, CompletionRequest, HealthResponse
from kvserve.server.openai.sampling import sampling_params
from kvserve.server.openai.streaming import SSE_HEADERS, sse
from kvserve.server.submission import Submission, collect_or_disconnect

UNSUPPORTED = "unsupported_task"        # a SEMANTIC_ERROR_CODES code: what this model cannot do

# The FIM tokens' spellings llama.cpp recognises (prefix, suffix, middle), as special tokens.
FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),           # StarCoder, SantaCoder
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),     # Qwen2.5-Coder, CodeGemma
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<PRE>", "<SUF>", "<MID>"),                                # CodeLlama
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),           # DeepSeek-Coder
)


COMPLETION_PATHS = ("/completion", "/completions")      # llama-server serves both
ROUTES = {      # for server/openapi.py
    **{("post", p): (LlamaCompletionRequest, LlamaCompletionResponse, True) for p in COMPLETION_PATHS},
    ("post", "/infill"): (LlamaInfillRequest, LlamaCompletionResponse, True),
    ("get", "/props"): (None, PropsResponse, False),
    ("get", "/slots"): (None, SlotsResponse, False),
    ("get", "/ping"): (None, HealthResponse, False),
}


def fim_token_ids(tok) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) FIM token ids, or None when it has none: a GGUF
    file's own (tokenizer.ggml.fim_*_token_id), else special tokens spelled as llama.cpp knows them."""
    if getattr(tok, "fim_ids", None) is not None:
        return tok.fim_ids
    special = getattr(tok, "special_tokens", None) or {}
    for spellings in FIM_SPELLINGS:
        if all(s in special for s in spellings):
            return tuple(special[s] for s in spellings)
    return None


def generation_settings(state) -> dict:
    """The defaults a /completion request gets for what it leaves out."""
    d = {**LLAMA_DEFAULTS, **state.generation_defaults}
    n_predict = state.generation_defaults.get("max_tokens", -1)
    return {"n_predict": n_predict, "temperature": d["temperature"], "top_k": d["top_k"],
            "top_p": d["top_p"], "min_p": d["min_p"], "seed": -1, "stop": [], "n_probs": 0,
            "ignore_eos": False, "repeat_penalty": d.get("repetition_penalty", 1.0), "repeat_last_n": -1,
            "cache_prompt": True, "stream": False,
            "prefix_cache": state.engine.config.cache.enable_prefix_caching}


def _openai_request(state, req: LlamaCompletionRequest, prompt) -> CompletionRequest:
    """The /v1/completions request that does what `req` asks."""
    fields: dict[str, Any] = {"prompt": prompt, "stream": req.stream, "ignore_eos": req.ignore_eos}
    n_predict = req.n_predict if req.n_predict is not None else state.generation_defaults.get("max_tokens", -1)
    fields["max_tokens"] = None if n_predict == -1 else n_predict
    for name in ("temperature", "top_p", "min_p", "grammar", "json_schema"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.top_k is not None:
        fields["top_k"] = req.top_k if req.top_k > 0 else -1
    if req.seed is not None and req.seed != -1:
        fields["seed"] = req.seed
    if req.stop:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.n_probs:
        fields["logprobs"] = req.n_probs
    if req.repeat_penalty is not None:
        fields["repetition_penalty"] = req.repeat_penalty     # (over the whole context: repeat_last_n -1)
    if req.logit_bias:
        pairs = req.logit_bias.items() if isinstance(req.logit_bias, dict) else req.logit_bias
        fields["logit_bias"] = {str(t): float(b) for t, b in pairs}
    if not req.cache_prompt:
        fields["cache_salt"] = f"cache_prompt-false-{uuid.uuid4().hex}"    # shares no block
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error_to_api_error(e) from None


async def _infill_prompt(state, req: LlamaInfillRequest) -> list[int]:
    """llama-server's FIM prompt: [BOS] <prefix> input_prefix <suffix> input_suffix <middle> prompt."""
    tok = state.tokenizer
    fim = fim_token_ids(tok) if tok is not None else None
    if fim is None:
        raise APIError("Infill is not supported by this model: its tokenizer has no fill-in-the-middle "
                       "tokens (<fim_prefix>/<fim_suffix>/<fim_middle> or their spellings)",
                       param="input_prefix", code=UNSUPPORTED)
    texts = [req.input_prefix, req.input_suffix] + ([req.prompt] if isinstance(req.prompt, str) else [])
    try:
        encoded = await state.tokenization.encode(texts, add_special_tokens=False)
    except ContextLengthError as e:
        raise context_error(e) from None
    middle = encoded[2] if isinstance(req.prompt, str) else list(req.prompt)
    bos = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
    return bos + [fim[0]] + encoded[0] + [fim[1]] + encoded[1] + [fim[2]] + middle


def _stop_type(c) -> tuple[str, str]:
    if c.finish_reason == "length":
        return "limit", ""
    if c.finish_reason == "stop":
        return ("word", c.stop_reason) if isinstance(c.stop_reason, str) else ("eos", "")
    return "none", ""


def _timings(out, num_prompt: int, num_cached: int, num_predicted: int) -> dict:
    m = out.metrics
    sched, first, last = (getattr(m, k, None) for k in ("first_scheduled_time", "first_token_time", "last_token_time"))
    prompt_ms = (first - sched) * 1e3 if sched is not None and first is not None else 0.0
    predicted_ms = (last - first) * 1e3 if first is not None and last is not None else 0.0
    prompt_n = num_prompt - num_cached

    def per(n, ms):
        return (ms / n if n else None), (n / ms * 1e3 if ms > 0 else None)
    ppt, pps = per(prompt_n, prompt_ms)
    gpt, gps = per(num_predicted, predicted_ms)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": ppt, "prompt_per_second": pps,
            "predicted_n": num_predicted, "predicted_ms": predicted_ms, "predicted_per_token_ms": gpt,
            "predicted_per_second": gps}


def _probabilities(state, context: list[int], c, k: int) -> list[dict]:
    """llama-server's completion_probabilities of a completion's tokens (ids, texts in context, logprobs)."""
    entries = logprob_entries(state, context, c.token_ids, c.logprobs, k)
    out = []
    for tid, table, (text, lp, alts) in zip(c.token_ids, c.logprobs, entries):
        top = sorted(table.items(), key=lambda kv: -kv[1].logprob)[:k]
        out.append({"id": tid, "token": text, "logprob": lp,
                    "top_logprobs": [{"id": t, "token": a[0], "logprob": a[1]} for (t, _), a in zip(top, alts)]})
    return out


def _settings(params, req) -> dict:
    return {"n_predict": params.max_tokens, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": params.min_p, "seed": params.seed if params.seed is not None else -1,
            "stop": list(params.stop or ()), "n_probs": req.n_probs, "ignore_eos": params.ignore_eos,
            "repeat_penalty": params.repetition_penalty, "cache_prompt": req.cache_prompt,
            "stream": req.stream, "grammar": req.grammar or "", "json_schema": req.json_schema}


async def _complete(state, req: LlamaCompletionRequest, request: Request, tenant, prompt):
    creq = _openai_request(state, req, prompt)
    state.tenancy.begin(tenant, creq)
    items = await prompt_items(state, creq)
    item = items[0]
    num_prompt = len(item["prompt_token_ids"])
    max_tokens = max_tokens_for(state, num_prompt, creq.max_tokens, 0)
    params = sampling_params(creq, max_tokens, creq.logprobs, None, creq.constraint(),
                             defaults={**LLAMA_DEFAULTS, **state.generation_defaults})
    sub = Submission(state, f"llama-{uuid.uuid4().hex}", stream=req.stream)
    try:
        if not await sub.add_all([(item, params)], request):
            sub.abort_unfinished()
            return Response(status_code=499)
    except BaseException:
        sub.abort_unfinished()
        raise
    tok = state.tokenizer
    prompt_text = item.get("prompt")
    if prompt_text is None:         # token ids (and /infill's prompt): decoded off the event loop
        try:
            prompt_text = (await state.tokenization.run_many(
                lambda ids: tok.decode(ids, skip_special_tokens=False), [item["prompt_token_ids"]]))[0] \
                if tok is not None else ""
        except BaseException:
            sub.abort_unfinished()
            raise
    settings = _settings(params, req)

    def final(out, c, content: str, tokens: list[int], probs) -> dict:
        stop_type, word = _stop_type(c)
        cached = out.num_cached_tokens or 0
        body = {"index": 0, "content": content, "tokens": tokens if req.return_tokens else [],
                "stop": True, "model": state.model_name, "tokens_predicted": len(tokens),
                "tokens_evaluated": num_prompt, "tokens_cached": cached, "generation_settings": settings,
                "prompt": prompt_text, "has_new_line": "\n" in content, "truncated": False,
                "stop_type": stop_type, "stopping_word": word,
                "timings": _timings(out, num_prompt, cached, len(tokens))}
        if probs is not None:
            body["completion_probabilities"] = probs
        return body

    if req.stream:
        return StreamingResponse(_stream(state, req, sub, item, final), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    done = await collect_or_disconnect(sub, request)
    if done is None:
        return Response(status_code=499)
    out = done[sub.request_ids[0]]
    c = out.outputs[0]
    probs = _probabilities(state, item["prompt_token_ids"], c, req.n_probs) if req.n_probs else None
    return JSONResponse(final(out, c, c.text, list(c.token_ids), probs))


async def _stream(state, req, sub, item, final):
    """llama-server's stream: a chunk per engine step that made tokens, then the whole answer's
    fields with `stop: true` (content ""); an engine error as an error event. No [DONE]."""
    context = list(item["prompt_token_ids"])
    tokens: list[int] = []
    text: list[str] = []
    try:
        async for out in sub.outputs():
            c = out.outputs[0]
            if c.token_ids or c.text:
                chunk = {"index": 0, "content": c.text, "tokens": list(c.token_ids) if req.return_tokens else [],
                         "stop": False, "tokens_predicted": len(tokens) + len(c.token_ids),
                         "tokens_evaluated": len(item["prompt_token_ids"])}
                if req.n_probs and c.logprobs:
                    chunk["completion_probabilities"] = _probabilities(state, context, c, req.n_probs)
                yield sse(chunk)
                tokens += c.token_ids
                context = (context + list(c.token_ids))[-64:]
                text.append(c.text)
            if out.finished:
                whole = final(out, c, "", tokens, None)
                whole["tokens"] = []
                yield sse(whole)
    except APIError as e:
        yield sse(e.body())
    finally:
        sub.abort_unfinished()


def install(app, state) -> None:
    """/completion, /infill, /props, /slots and /ping on `app`."""

    def health():
        dead = state.core_client.dead
        if dead is not None:
            return JSONResponse({"status": "error", "error": state.engine_failure.message(dead)}, 500)
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    async def ping():
        return health()

    @app.post("/ping", include_in_schema=False)      # (a POST without a body: GET's schema says it)
    async def ping_post():
        return health()

    async def completion(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, LlamaCompletionRequest)
        return await _complete(state, req, request, tenant, req.prompt)

    for path in COMPLETION_PATHS:
        app.add_api_route(path, completion, methods=["POST"], operation_id=f"llama{path.replace('/', '_')}")

    @app.post("/infill")
    async def infill(request: Request):
        tenant = state.tenancy.authenticate(request)
        req = await parse_body(state, request, LlamaInfillRequest)
        return await _complete(state, req, request, tenant, await _infill_prompt(state, req))

    @app.get("/props")
    async def props(request: Request):
        state.tenancy.authenticate(request, limit=False)
        tok = state.tokenizer
        return {"default_generation_settings": {"n_ctx": state.max_model_len, "params": generation_settings(state)},
                "total_slots": state.engine.limits.max_num_seqs, "model_path": state.engine.config.model.model,
                "chat_template": state.chat.source if state.chat is not None and state.chat.source else "",
                "bos_token": getattr(tok, "bos_token", None), "eos_token": getattr(tok, "eos_token", None),
                "modalities": {"vision": False, "audio": False}, "build_info": f"kvserve {kvserve_version()}"}

    @app.get("/slots")
    async def slots(request: Request, fail_on_no_slot: bool = False):
        """A slot is a seat of the engine (max_num_seqs); kvserve does not pin a request to one,
        so the first num_running (the engine's running requests) are the busy ones."""
        state.tenancy.authenticate(request, limit=False)
        total = state.engine.limits.max_num_seqs
        busy = min(total, state.core_client.last_stats.num_running)
        if fail_on_no_slot and busy >= total:
            raise APIError("no slot available", 503, type="server_error", code="unavailable_error")
        speculative = state.engine.config.speculative is not None
        return [{"id": i, "n_ctx": state.max_model_len, "speculative": speculative, "is_processing": i < busy,
                 "params": generation_settings(state)} for i in range(total)]

    # llama-server's writes: it too refuses them unless started with --props / --slot-save-path
    # (501, its not_supported_error); kvserve has neither, so they are refused always. They exist
    # only to say so, and stay out of the served schema.
    @app.post("/props", include_in_schema=False)
    async def set_props(request: Request):
        state.tenancy.authenticate(request, limit=False)
        raise APIError("kvserve's settings are fixed when it starts (llama-server's --props is not "
                       "built): restart it with other flags", 501, type="not_supported_error")

    @app.post("/slots/{id_slot}", include_in_schema=False)
    async def slot_action(request: Request, id_slot: int, action: str = ""):
        state.tenancy.authenticate(request, limit=False)
        raise APIError(f"slot action {action!r}: kvserve pins no request to a slot, so no slot holds a "
                       "KV cache to save, restore or erase (llama-server's --slot-save-path is not built); "
                       "the prefix cache keeps and reuses prompts by itself", 501, type="not_supported_error",
                       param="action")
