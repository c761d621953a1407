"""Layer-wise KV streaming through `kvserve proxy` (kvserve/fleet/pd_proxy.py, kv/stream_*.py): a
`--role prefill --kv-transfer stream` server sends each layer's KV over TCP to a `--role decode
--kv-transfer stream` server while the prefill runs, with no shared store at all. Greedy answers
equal a collocated engine's, streamed or not, and the decode instance's prompt tokens came from
the stream (cached_tokens; its /metrics counts the transfers). A decode instance whose stream
buffer cannot hold the prompt refuses before the prefill (503 with Retry-After); with the
prefill instance gone the decode instance computes the prompt at once (the transfer is
cancelled), and the answer is the same."""
from __future__ import annotations

import httpx

from tests.fleet.live import scrape, start_replicas
from tests.fleet.test_pd import MAX_TOKENS, PROMPTS, LiveProxy, complete, want  # noqa: F401 (fixture)


def _events(url: str) -> dict:
    """kvserve:kv_stream_events_total by event, summed over roles."""
    text = httpx.get(url + "/metrics", trust_env=False, timeout=10).text
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("kvserve:kv_stream_events_total{"):
            event = line.split('event="')[1].split('"')[0]
            out[event] = out.get(event, 0) + float(line.rsplit(" ", 1)[1])
    return out


def test_streamed_answers_are_exact_and_the_kv_came_over_the_stream(want):
    prefill = start_replicas(1, "--role", "prefill", "--kv-transfer", "stream", "--block-size", "4")
    decode = start_replicas(1, "--role", "decode", "--kv-transfer", "stream", "--block-size", "4")
    small = start_replicas(1, "--role", "decode", "--kv-transfer", "stream", "--kv-stream-buffer", "1KiB")
    proxy = LiveProxy(prefill.urls, decode.urls)
    tight = LiveProxy(prefill.urls, small.urls)
    try:
        health = httpx.get(decode.urls[0] + "/health", trust_env=False, timeout=10).json()
        assert health["kv_stream"].startswith("127.0.0.1:")
        for prompt, ref, stream in zip(PROMPTS, want, (False, True, False)):
            text, usage = complete(proxy.url, prompt, stream)
            assert text == ref
            # the decode instance never saw the prompt: all but its last partial block streamed in
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
        ev = _events(decode.urls[0])
        assert ev.get("reserved") == 3 and ev.get("streamed") == 3, ev
        assert not any(k.startswith("fallback") for k in ev), ev
        assert _events(prefill.urls[0])["done"] == 3
        assert scrape(proxy.url)["kvserve:proxy_kv_streams_total"] == 3

        # backpressure: the prompt's KV does not fit the decode instance's 1 KiB stream buffer
        r = httpx.post(tight.url + "/v1/completions", trust_env=False, timeout=60,
                       json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "room for this prompt's KV" in r.json()["error"]["message"]
        assert scrape(tight.url)["kvserve:proxy_kv_stream_refused_total"] == 1
        assert _events(prefill.urls[0]).get("opened") == 3          # no prefill work was started

        # no prefill instance: the transfer is cancelled and the decode instance computes the prompt
        prefill.stop()
        text, usage = complete(proxy.url, PROMPTS[1])
        assert text == want[1]
        assert any(k.startswith("fallback:cancelled") for k in _events(decode.urls[0]))
    finally:
        proxy.stop()
        tight.stop()
        prefill.stop()
        decode.stop()
        small.stop()
