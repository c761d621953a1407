"""The OpenAI API of `kvserve serve`, driven by the official `openai` SDK against a live server
on 127.0.0.1, and compared token for token with `LLM.generate` on the same model."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from kvserve import SamplingParams
from kvserve.server.openai.chat_renderer import FALLBACK_CHAT_TEMPLATE

from .live import LiveServer, reference_llm

MODEL = "stories260K-hf"
PROMPTS = ["Once upon a time", "Lily went to the park", "The cat was", "Tom had a big red ball",
           "One day, a little bird", "Sue and Ben", "There was a dog named", "The sun was hot and"]


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--max-num-seqs", "64")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def llm():
    with reference_llm() as m:
        yield m


def reference(llm, prompts, max_tokens, **kw) -> list[str]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw))
    return [o.outputs[0].text for o in outs]


def test_health_and_models(server, client):
    assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_greedy_equals_llm_generate(client, llm):
    want = reference(llm, PROMPTS[:3], 24)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=24, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == want
    assert all(c.finish_reason in ("stop", "length") for c in resp.choices)
    # usage counts exactly the tokens the engine saw and produced
    full = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=24))
    assert resp.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in full)
    assert resp.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in full)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_stream_equals_non_stream(client, llm):
    want = reference(llm, [PROMPTS[0]], 40)[0]
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.text)
            finish = ch.finish_reason or finish
    assert "".join(pieces) == want
    assert len([p for p in pieces if p]) > 5          # it really streamed, piece by piece
    assert finish in ("stop", "length")
    full = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert usage.completion_tokens == len(full.outputs[0].token_ids)
    assert usage.prompt_tokens == len(full.prompt_token_ids)
    assert len(pieces) == usage.completion_tokens      # one chunk per token: chunk times are token times


def test_completion_token_id_prompt_and_echo(client, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[1])
    want = reference(llm, [PROMPTS[1]], 16)[0]
    resp = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    assert resp.choices[0].text == want
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, echo=True)
    assert resp.choices[0].text == PROMPTS[1] + want


def test_stop_string(client, llm):
    full = reference(llm, [PROMPTS[0]], 40)[0]
    word = full.split()[3]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[word])
    c = resp.choices[0]
    assert c.finish_reason == "stop"
    assert word not in c.text
    assert full.startswith(c.text)


def test_chat_uses_fallback_template_and_equals_llm_generate(client, llm):
    import jinja2

    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about a cat."}]
    rendered = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(
        FALLBACK_CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert rendered == "System: You tell short stories.\nUser: Tell me about a cat.\nAssistant:"
    want = reference(llm, [rendered], 24)[0]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want
    assert resp.usage.prompt_tokens == len(llm.get_tokenizer().encode(rendered))

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    roles, content, finish = [], [], None
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            content.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert roles == ["assistant"]
    assert "".join(content) == want
    assert finish in ("stop", "length")


def test_n_samples(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                                     n=3, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1        # different samples
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                                      n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]   # seeded: reproducible
    # streamed: each choice's pieces add up to the same samples, and each finishes exactly once
    texts, finishes = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=1.0,
                                           n=3, seed=7, stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert finishes == {0: 1, 1: 1, 2: 1}
    roles, chat_texts = {}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, temperature=1.0, n=2, seed=1, stream=True):
        for ch in chunk.choices:
            if ch.delta.role:
                roles[ch.index] = roles.get(ch.index, 0) + 1
            chat_texts[ch.index] = chat_texts.get(ch.index, "") + (ch.delta.content or "")
    assert roles == {0: 1, 1: 1}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=8, temperature=1.0, n=2, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens > 0
    assert [chat_texts[i] for i in range(2)] == [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)]


def test_completion_logprobs(client, llm):
    want = reference(llm, [PROMPTS[3]], 10)[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0, logprobs=3)
    c = resp.choices[0]
    assert c.text == want
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    for tok, chosen, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert chosen <= 0.0
        assert 1 <= len(top) <= 4
        # greedy: the chosen token has the highest log-probability of all
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert c.text[off:off + len(tok)] == tok


def test_chat_logprobs_stream_and_not(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8,
              temperature=0, logprobs=True, top_logprobs=2)
    resp = client.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert bytes(t.bytes).decode("utf-8") == t.token
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.logprobs and ch.logprobs.content:
                streamed.extend(ch.logprobs.content)
    assert [(t.token, round(t.logprob, 5)) for t in streamed] == \
        [(t.token, round(t.logprob, 5)) for t in content]


def _wait_idle(server, timeout=20.0) -> dict:
    return server.wait_idle(timeout)


ABORTED = 'kvserve:request_success_total{finished_reason="abort",model_name="stories260K-hf"}'
FINISHED_LENGTH = 'kvserve:request_success_total{finished_reason="length",model_name="stories260K-hf"}'


def test_32_concurrent_streams_get_their_solo_answers(server, llm):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {'and ' * (i // len(PROMPTS))}".strip() for i in range(32)]
    lengths = [8 + (i * 7) % 33 for i in range(32)]         # 8..40 tokens: requests finish at different steps
    want = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
            for p, n in zip(prompts, lengths)]

    async def one(ac, p, n):
        stream = await ac.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        parts = []
        async for chunk in stream:
            for ch in chunk.choices:
                parts.append(ch.text)
        return "".join(parts)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      http_client=httpx.AsyncClient(trust_env=False, timeout=120)) as ac:
            return await asyncio.gather(*(one(ac, p, n) for p, n in zip(prompts, lengths)))

    before = _wait_idle(server)
    got = asyncio.run(main())
    # whoever shared a step with whom, every stream is its request's solo greedy answer
    assert got == want
    # (bounded wait: a client can read its last chunk before the engine loop publishes its stats)
    after = _wait_idle(server)
    assert httpx.get(server.base_url + "/health", trust_env=False).status_code == 200
    # every token was counted
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == sum(lengths)
    assert after[FINISHED_LENGTH] - before.get(FINISHED_LENGTH, 0.0) == 32
    # Steps, whatever the arrival timing: a step gives a request at most one token, so the longest
    # request alone needs max(lengths) steps; 32 requests served one after another need sum(lengths)
    # steps (an idle engine does not step, and --max-num-seqs 64 holds none of them back for a
    # seat). Fewer than sum(lengths) steps means requests of different clients shared forward passes.
    steps = after["kvserve:engine_steps_total"] - before["kvserve:engine_steps_total"]
    assert max(lengths) <= steps < sum(lengths)


def test_disconnect_mid_stream_frees_blocks(server):
    before = _wait_idle(server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(trust_env=False, timeout=60) as hc:
        with hc.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()        # kept: dropping the iterator would close the response
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["finish_reason"] is None
            # one token of 480 is out: the request holds a seat and KV blocks
            m = server.metrics()
            assert m["kvserve:num_requests_running"] == 1
            assert m["kvserve:num_kv_blocks_free"] < m["kvserve:num_kv_blocks_total"]
        # leaving the block closes the connection mid-stream
    m = _wait_idle(server, timeout=10)          # every block back in the pool
    assert m[ABORTED] == before.get(ABORTED, 0.0) + 1
    assert m[FINISHED_LENGTH] == before.get(FINISHED_LENGTH, 0.0)        # it never reached its 480 tokens
    assert m["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < 480


def test_disconnect_non_streaming_aborts(server):
    before = _wait_idle(server)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0,
                       "ignore_eos": True}).encode()
    # A raw connection: send the request, wait until the engine runs it, then hang up. No client
    # timeout races the engine; the server learns of the disconnect while it computes the answer.
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        m = server.wait_for("the 500-token request running (or finished)",
                            lambda m: m["kvserve:num_requests_running"] == 1 or
                            m.get(FINISHED_LENGTH, 0.0) > before.get(FINISHED_LENGTH, 0.0))
        assert m["kvserve:num_requests_running"] == 1, "the request finished before the client could leave"
    m = _wait_idle(server, timeout=10)
    assert m[ABORTED] == before.get(ABORTED, 0.0) + 1
    assert m.get(FINISHED_LENGTH, 0.0) == before.get(FINISHED_LENGTH, 0.0)
    assert m["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < 500


def test_metrics_histograms_follow_requests(server, client):
    _wait_idle(server)
    before = server.metrics()
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = _wait_idle(server)
    n = resp.usage.completion_tokens
    assert n == 20

    def d(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert d("kvserve:time_to_first_token_seconds_count") == 1
    assert d("kvserve:e2e_request_latency_seconds_count") == 1
    assert d("kvserve:time_per_output_token_seconds_count") == 1
    assert d("kvserve:request_queue_time_seconds_count") == 1
    assert d("kvserve:inter_token_latency_seconds_count") == n - 1
    assert d("kvserve:generation_tokens_total") == n
    assert d("kvserve:prompt_tokens_total") == resp.usage.prompt_tokens
    assert d("kvserve:request_generation_tokens_sum") == n
    # TTFT <= E2E, and the ITL sum is the decode time
    assert d("kvserve:time_to_first_token_seconds_sum") <= d("kvserve:e2e_request_latency_seconds_sum")
    assert d("kvserve:inter_token_latency_seconds_sum") == pytest.approx(
        d("kvserve:request_decode_time_seconds_sum"), rel=1e-6, abs=1e-9)
    text = httpx.get(server.base_url + "/metrics", trust_env=False).text
    for name in ("kvserve:kv_cache_usage_perc", "kvserve:num_requests_waiting", "kvserve:num_preemptions_total",
                 "kvserve:prefix_cache_queries_total"):
        assert name in text


def test_prefix_cache_hits_show_in_usage_and_metrics(server, client):
    _wait_idle(server)
    # a prompt of several full 16-token blocks, unique to this test
    prompt = "The little red hen found a grain of wheat and asked her friends to help her plant it. " * 3
    before = server.metrics()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})
    after = server.metrics()
    n = first.usage.prompt_tokens
    assert n >= 48
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * ((n - 1) // 16) - 16
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert salted.usage.prompt_tokens_details.cached_tokens == 0       # another tenant shares nothing
    assert second.choices[0].text == first.choices[0].text == salted.choices[0].text
    hits = after["kvserve:prefix_cache_hits_total"] - before["kvserve:prefix_cache_hits_total"]
    assert hits == second.usage.prompt_tokens_details.cached_tokens
    assert after["kvserve:prefix_cache_queries_total"] - before["kvserve:prefix_cache_queries_total"] >= 3 * n - 3


def test_stream_several_prompts_keeps_choices_apart(client, llm):
    want = reference(llm, PROMPTS[4:7], 12)
    texts, finishes = {}, {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[4:7], max_tokens=12, temperature=0,
                                           stream=True):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
    assert [texts[i] for i in range(3)] == want
    assert finishes == {0: 1, 1: 1, 2: 1}
