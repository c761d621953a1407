"""Logprobs in OpenAI's shapes: the completions API's `logprobs` object (tokens, token_logprobs,
top_logprobs, text_offset; echoed prompts included) and the chat API's `content` list, from
the engine's `{token_id: Logprob}` tables. A token's text is read in context so that the texts
join up to the completion text; with vLLM's `return_tokens_as_token_ids` a token is named
"token_id:N" instead, so a client can tell apart tokens whose texts are equal or not valid
UTF-8 alone. `prompt_logprobs_table` is vLLM's `prompt_logprobs`: per prompt token a map of token
id to {logprob, rank, decoded_token}, None for the first."""
from __future__ import annotations

from dataclasses import replace

from kvserve.server.openai.protocol import ChatLogprobToken, ChatTopLogprob, CompletionLogProbs


CONTEXT_TOKENS = 6


def logprob_entries(state, context: list[int], token_ids: list[int], tables: list[dict],
                     k: int, skip_special: bool = True,
                     as_ids: bool = False) -> list[tuple[str, float | None, list[tuple[str, float]]]]:
    """(token text, its logprob, top-k [(text, logprob)]) for each token; a None table (the
    first prompt token, which nothing predicts) gives (text, None, None).

    A token's text is what it adds to the decoded text *in context* -- decode(context + token)
    minus decode(context) -- because SentencePiece-style tokens decoded alone lose their leading
    space. The last few tokens before it (prompt and earlier output) are the context; so the
    chosen tokens' texts concatenate to the completion text.
    """
    if as_ids:
        return [(f"token_id:{tid}", _chosen(table, tid),
                 [(f"token_id:{t}", lp.logprob) for t, lp in _top(table, k)] if table is not None else None)
                for tid, table in zip(token_ids, tables)]
    tok = state.tokenizer
    seq = list(context[-CONTEXT_TOKENS:])

    def piece(prev_text: str, ids: list[int], tid: int) -> str:
        if tok is None:
            return str(tid)
        text = tok.decode(ids, skip_special_tokens=skip_special)
        if text.startswith(prev_text):
            return text[len(prev_text):]
        return tok.decode([tid], skip_special_tokens=skip_special)

    prev = tok.decode(seq, skip_special_tokens=skip_special) if tok is not None else ""
    out = []
    for tid, table in zip(token_ids, tables):
        top = _top(table, k) if table is not None else None
        alts = [(piece(prev, seq + [t], t), lp.logprob) for t, lp in top] if top is not None else None
        seq.append(tid)
        text = piece(prev, seq, tid)
        prev = prev + text
        if len(seq) > 4 * CONTEXT_TOKENS:      # keep decoding cheap on long outputs
            seq = seq[-CONTEXT_TOKENS:]
            prev = tok.decode(seq, skip_special_tokens=skip_special) if tok is not None else ""
        out.append((text, _chosen(table, tid), alts))
    return out


def _chosen(table: dict | None, tid: int) -> float | None:
    entry = table.get(tid) if table is not None else None
    return entry.logprob if entry is not None else None


def _top(table: dict, k: int) -> list:
    return sorted(table.items(), key=lambda kv: -kv[1].logprob)[:k]


def prompt_logprobs_table(state, out, as_ids: bool = False) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a finished output: per prompt token, None for the first (which
    nothing predicts), else {token id: {"logprob", "rank", "decoded_token"}} for the prompt's
    token and the top alternatives."""
    tok = state.tokenizer

    def name(tid: int) -> str:
        if as_ids or tok is None:
            return f"token_id:{tid}"
        return tok.decode([tid], skip_special_tokens=False)
    tables = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return [None if t is None else {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                                               "decoded_token": lp.decoded_token if lp.decoded_token is not None
                                               and not as_ids else name(tid)}
                                    for tid, lp in t.items()}
            for t in tables]


def completion_logprobs(state, context: list[int], token_ids: list[int], logprobs: list[dict],
                        start_offset: int, k: int, skip_special: bool, as_ids: bool = False) -> CompletionLogProbs:
    out = CompletionLogProbs()
    offset = start_offset
    for text, chosen, alts in logprob_entries(state, context, token_ids, logprobs, k, skip_special, as_ids):
        out.tokens.append(text)
        out.token_logprobs.append(chosen)
        top = None
        if alts is not None:        # tokens that read the same keep the likelier one's logprob
            top = {}
            for t, v in alts:
                top.setdefault(t, v)
        if chosen is not None:
            top.setdefault(text, chosen)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def without_tokens(c):
    """echo with max_tokens=0 (vLLM's rule): completion `c` without the one token generated to
    get there (finished with "length")."""
    return replace(c, text="", token_ids=[], stop_reason=None,
                   finish_reason="length" if c.finish_reason is not None else None,
                   logprobs=[] if c.logprobs is not None else None)


def echo_only(out):
    """echo with max_tokens=0: the output without the one token generated to get there."""
    return replace(out, outputs=[without_tokens(c) for c in out.outputs])


def echo_logprobs(state, out, c, k: int, skip_special: bool, as_ids: bool = False) -> CompletionLogProbs:
    """echo with logprobs: the prompt's tokens (a null logprob for the first, which nothing
    predicts), then completion `c`'s (None: the prompt alone), with text offsets from the start
    of the prompt's text."""
    ids, tables = out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    if c is not None:
        ids, tables = ids + c.token_ids, tables + (c.logprobs or [])
    return completion_logprobs(state, [], ids, tables, 0, k, skip_special, as_ids)


def chat_logprobs(state, context: list[int], token_ids: list[int], logprobs: list[dict],
                  k: int, skip_special: bool, as_ids: bool = False) -> list[ChatLogprobToken]:
    content = []
    for text, chosen, alts in logprob_entries(state, context, token_ids, logprobs, k, skip_special, as_ids):
        content.append(ChatLogprobToken(
            token=text, logprob=chosen if chosen is not None else -9999.0, bytes=list(text.encode("utf-8")),
            top_logprobs=[ChatTopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in alts]))
    return content
