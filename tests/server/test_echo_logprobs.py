"""`/v1/completions` with `echo` and `logprobs` returns the prompt's tokens with their logprobs in
OpenAI's completions format, as lm-eval's `local-completions` loglikelihood requests need:
`tokens` (texts that concatenate to the echoed text), `token_logprobs` (null for the first
token), `top_logprobs` (null for the first), `text_offset`; `max_tokens=0` only with echo
(nothing generated). In-process app on stories260K; values against transformers."""
from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.app import build_app
from tests.reference.hf_reference import load_hf

from .live import STORIES_HF

PROMPT = "Once upon a time, there was a little girl named Lily. She"


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine(EngineConfig(model=str(STORIES_HF), block_size=4, max_num_batched_tokens=16,
                                    max_num_seqs=4))
    with TestClient(build_app(engine, "stories")) as c:
        c.engine = engine
        yield c


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(load_hf(str(STORIES_HF))(torch.tensor([ids])).logits[0].float(), dim=-1)


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": "stories", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_part(lp: dict, ids: list[int], k: int) -> None:
    ref = hf_logprobs(ids)
    n = len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for j in range(1, n):
        assert abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) < 1e-4
        top = lp["top_logprobs"][j]
        want = ref[j - 1].topk(k).values.tolist()
        assert len(top) in (k, k + 1)          # the top k texts, plus the token's own if not among them
        assert sorted(top.values(), reverse=True)[:k] == pytest.approx(want, abs=1e-4)
        assert top[lp["tokens"][j]] == pytest.approx(lp["token_logprobs"][j], abs=1e-6)
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets


def test_echo_max_tokens_0_scores_the_prompt(client):
    ids = client.engine.tokenizer.encode(PROMPT)
    out = completion(client, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    (choice,) = out["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    check_prompt_part(lp, ids, 2)
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)


def test_echo_with_generation_appends_the_completion(client):
    ids = client.engine.tokenizer.encode(PROMPT)
    plain = completion(client, prompt=PROMPT, logprobs=1, max_tokens=5)["choices"][0]
    choice = completion(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=5)["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT + plain["text"]
    assert len(lp["tokens"]) == len(ids) + 5
    check_prompt_part(lp, ids, 1)
    assert lp["token_logprobs"][len(ids):] == plain["logprobs"]["token_logprobs"]
    assert lp["tokens"][len(ids):] == plain["logprobs"]["tokens"]


def test_lm_eval_style_token_prompts(client):
    """local-completions sends token ids, echo, logprobs=1 and max_tokens=1, and reads
    token_logprobs[ctxlen:-1]."""
    tok = client.engine.tokenizer
    batch = [tok.encode("The cat sat on the mat."), tok.encode("Tom had a big red ball and a small dog")]
    out = completion(client, prompt=batch, echo=True, logprobs=1, max_tokens=1)
    for ids, choice in zip(batch, out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        check_prompt_part({k: v[:len(ids)] for k, v in lp.items()}, ids, 1)


def test_echo_logprobs_stream_equals_non_stream(client):
    want = completion(client, prompt=PROMPT, echo=True, logprobs=1, max_tokens=4)["choices"][0]
    text, tokens, lps, offsets = "", [], [], []
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1,
                                                        "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text += ch["text"]
                    if ch["logprobs"]:
                        tokens += ch["logprobs"]["tokens"]
                        lps += ch["logprobs"]["token_logprobs"]
                        offsets += ch["logprobs"]["text_offset"]
    assert text == want["text"]
    assert tokens == want["logprobs"]["tokens"] and lps == want["logprobs"]["token_logprobs"]
    assert offsets == want["logprobs"]["text_offset"]


def test_max_tokens_0_needs_echo(client):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == PROMPT
