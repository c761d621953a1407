"""What the bench client sends and how it times the stream, against canned server responses:
token-id prompts, and the chunks that carry no token (llama-server's closing chunk, a chat
stream's role chunk) kept out of TTFT and ITL."""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from kvserve.bench.client import Target, send_request, token_events
from kvserve.bench.datasets import Turn
from kvserve.bench.serve import add_cli_args


def _args(*argv):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(["--ignore-eos", *argv])


def _sse(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def _run(body: bytes, turn: Turn, endpoint="/v1/completions"):
    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, Target("http://x", "m", endpoint), turn, _args(), None, 0.0)

    return asyncio.run(go()), sent


def test_token_ids_are_sent_and_llama_servers_closing_chunk_is_no_token():
    # llama-server: one chunk per token, then a chunk of empty text with finish_reason and usage
    tok = lambda t: {"choices": [{"index": 0, "text": t, "finish_reason": None}]}  # noqa: E731
    body = _sse(tok("a"), tok("b"), tok("c"),
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    r, sent = _run(body, Turn("ignored text", 3, 5, prompt_token_ids=[7, 8, 9, 10, 11], exact_len=True))
    assert sent["prompt"] == [7, 8, 9, 10, 11] and sent["max_tokens"] == 3 and sent["ignore_eos"] is True
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert r.success and r.usage_reported and r.generated_text == "abc"
    assert (r.prompt_len, r.requested_prompt_len, r.output_len) == (5, 5, 3)
    assert r.extra_chunks == 1 and len(r.itl) == 2             # 3 tokens: 2 gaps, not 3


def test_kvserve_style_stream_keeps_every_chunk():
    # kvserve / vLLM: the last token's chunk carries finish_reason, usage comes with no choices
    body = _sse({"choices": [{"text": "a", "finish_reason": None}]},
                {"choices": [{"text": "", "finish_reason": None}]},      # a token with no text yet
                {"choices": [{"text": "b", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    r, sent = _run(body, Turn("hello", 3, 8, exact_len=True))
    assert sent["prompt"] == "hello"
    assert (r.prompt_len, r.requested_prompt_len, r.output_len, r.extra_chunks) == (9, 8, 3, 0)
    assert len(r.itl) == 2


def test_chat_role_chunk_is_no_token():
    body = _sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": "x"}}]},
                {"choices": [{"delta": {"content": "y"}, "finish_reason": "length"}],
                 "usage": {"prompt_tokens": 20, "completion_tokens": 2}})
    r, sent = _run(body, Turn("hi", 2, 1), endpoint="/v1/chat/completions")
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert r.output_len == 2 and r.extra_chunks == 1 and len(r.itl) == 1 and r.generated_text == "xy"


def test_token_events_without_usage_counts_every_chunk():
    ev = [(0.1, True, False, False), (0.2, False, True, False)]
    assert token_events(ev, None) == [0.1, 0.2]
    assert token_events(ev, 1) == [0.1]
    assert token_events(ev, 2) == [0.1, 0.2]
    # a surplus chunk that has text is a token the usage undercounts: it is kept
    assert token_events([(0.1, True, False, False), (0.2, True, True, False)], 1) == [0.1, 0.2]
