"""`POST /v1/completions`: each prompt one engine request with `n` samples (its prompts bounded
and tokenized by server/openai/prompts.py), and each choice's text -- with `echo`, the prompt's
text before it; with `logprobs` and `prompt_logprobs`, OpenAI's and vLLM's tables
(server/openai/logprobs.py) -- whole or streamed (server/openai/streaming.py). `max_tokens` 0
with `echo` is vLLM's rule: one token generated, none of it returned."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.server.openai.logprobs import completion_logprobs, echo_logprobs, echo_only, prompt_logprobs_table
from kvserve.server.openai.prompts import echo_texts, max_tokens_for, prompt_items, request_ids
from kvserve.server.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from kvserve.server.openai.sampling import sampling_params
from kvserve.server.openai.streaming import SSE_HEADERS, stream_completions, usage_of
from kvserve.server.submission import Submission, collect_or_disconnect


async def completions(state, req: CompletionRequest, request: Request):
    items = await prompt_items(state, req)
    max_tokens = [max_tokens_for(state, len(item["prompt_token_ids"]), req.max_tokens, req.min_tokens)
                  for item in items]
    # echo with max_tokens=0 (vLLM's rule): generate one token, return none of it.
    constraint = req.constraint()
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    params = [sampling_params(req, max(m, 1), req.logprobs, max(asked) if asked else None, constraint,
                              defaults=state.generation_defaults)
              for m in max_tokens]
    rid_prefix, engine_prefix, headers = request_ids("cmpl", req, request)
    created = int(time.time())
    sub = Submission(state, engine_prefix, stream=req.stream)
    try:
        if not await sub.add_all(list(zip(items, params)), request):
            sub.abort_unfinished()                  # the client left while its prompts were added
            return Response(status_code=499)
    except BaseException:
        sub.abort_unfinished()
        raise
    index_of = {rid: i for i, rid in enumerate(sub.request_ids)}
    try:        # echo's texts, once the engine has accepted the prompts' token ids
        prompt_texts = await echo_texts(state, req, items)
    except BaseException:
        sub.abort_unfinished()
        raise

    if req.stream:
        return StreamingResponse(stream_completions(state, req, sub, rid_prefix, created, index_of,
                                                    prompt_texts),
                                 media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    final = await collect_or_disconnect(sub, request)
    if final is None:
        return Response(status_code=499)
    choices = []
    outs = [final[rid] for rid in sub.request_ids]
    outs = [echo_only(out) if req.max_tokens == 0 else out for out in outs]
    for pi, out in enumerate(outs):
        prefix_text = prompt_texts[pi] if req.echo else ""
        for c in out.outputs:
            lp = None
            as_ids = req.return_tokens_as_token_ids
            if req.logprobs is not None and req.echo:
                lp = echo_logprobs(state, out, c, req.logprobs, req.skip_special_tokens, as_ids)
            elif req.logprobs is not None and c.logprobs is not None:
                lp = completion_logprobs(state, out.prompt_token_ids, c.token_ids, c.logprobs,
                                         len(prefix_text), req.logprobs, req.skip_special_tokens, as_ids)
            plp = prompt_logprobs_table(state, out, as_ids) if req.prompt_logprobs is not None else None
            choices.append(CompletionChoice(index=pi * req.n + c.index, text=prefix_text + c.text,
                                            logprobs=lp, finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason, prompt_logprobs=plp))
    body = CompletionResponse(id=rid_prefix, created=created, model=state.model_name,
                              choices=choices, usage=usage_of(outs)).model_dump()
    return JSONResponse(body, headers=headers) if headers else body
