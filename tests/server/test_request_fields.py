"""No request field is silently ignored: every field of the chat and completions request models is
either honoured -- a behavioural check here, or a named test elsewhere -- or refused with a 400.
The models hold vLLM's and llama-server's request fields too (server/openai/extension_fields.py),
so none of those lands in the `kvserve-ignored-fields` header (`test_no_vllm_or_llama_field_is_ignored`).

`test_every_field_has_a_check` fails when a field is added to a request model without one.
Unknown fields are accepted (newer clients send newer fields) but named in the log and in the
`kvserve-ignored-fields` response header.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.server.app import build_app
from kvserve.server.body import IGNORED_FIELDS_HEADER
from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest

from tests.server.live import STORIES_HF

TESTS = Path(__file__).resolve().parents[1]
EOS = 2                     # stories260K's </s>
THINKING_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}{% if think %}Thinking:{% endif %}Assistant:{% endif %}")


@pytest.fixture(scope="module")
def app():
    engine = EngineCore(EngineConfig(model=str(STORIES_HF)))
    with TestClient(build_app(engine, "stories", chat_template=THINKING_TEMPLATE)) as client:
        yield client


class Api:
    """One endpoint of the server: greedy, short requests, and what they returned."""

    def __init__(self, client, endpoint: str):
        self.client, self.endpoint = client, endpoint

    def body(self, **kw) -> dict:
        base = {"max_tokens": 8, "temperature": 0}
        if self.endpoint == "chat":
            base["messages"] = [{"role": "user", "content": "Once upon a time"}]
        else:
            base["prompt"] = "Once upon a time"
        return {**base, **kw}

    def post(self, **kw):
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.client.post(path, json=self.body(**kw))

    def ok(self, **kw) -> dict:
        r = self.post(**kw)
        assert r.status_code == 200, r.text
        return r.json()

    def text(self, **kw) -> str:
        choice = self.ok(**kw)["choices"][0]
        return choice["message"]["content"] if self.endpoint == "chat" else choice["text"]

    def refused(self, param: str, **kw) -> dict:
        r = self.post(**kw)
        assert r.status_code in (400, 404), r.text
        err = r.json()["error"]
        assert param in (err["param"] or "") or param in err["message"], err
        return err

    def token_ids(self, **kw) -> list[int]:
        lp = self.ok(logprobs=True if self.endpoint == "chat" else 0, return_tokens_as_token_ids=True, **kw)
        lp = lp["choices"][0]["logprobs"]
        tokens = [t["token"] for t in lp["content"]] if self.endpoint == "chat" else lp["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]

    def stream_events(self, **kw) -> list[dict]:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        r = self.client.post(path, json=self.body(stream=True, **kw))
        assert r.status_code == 200, r.text
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _sampled_differs(api: Api, **kw) -> bool:
    greedy = api.text(max_tokens=16)
    return any(api.text(max_tokens=16, temperature=1.0, seed=s, **kw) != greedy for s in range(8))


# ------------------------------------------------------------------ checks both endpoints share

def check_model(api):
    api.ok(model="stories")
    assert api.refused("model", model="no-such-model")["code"] == "model_not_found"


def check_n(api):
    assert len(api.ok(n=3, temperature=1.0, seed=1)["choices"]) == 3


def check_temperature(api):
    assert api.text() == api.text(temperature=0.0)
    assert _sampled_differs(api)


def check_top_p(api):        # a top_p this small keeps only the most likely token: greedy
    assert all(api.text(max_tokens=16, temperature=1.0, seed=s, top_p=1e-6) == api.text(max_tokens=16)
               for s in range(3))
    assert _sampled_differs(api, top_p=1.0)


def check_top_k(api):
    assert all(api.text(max_tokens=16, temperature=1.0, seed=s, top_k=1) == api.text(max_tokens=16)
               for s in range(3))


def check_min_p(api):        # min_p 1: only tokens as likely as the most likely one
    assert all(api.text(max_tokens=16, temperature=1.0, seed=s, min_p=1.0) == api.text(max_tokens=16)
               for s in range(3))


def check_seed(api):
    a = [api.text(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    assert a == [api.text(max_tokens=16, temperature=1.0, seed=s) for s in (1, 2, 3)]
    assert len(set(a)) > 1


def check_stop(api):
    full = api.text(max_tokens=16)
    word = full.split()[2]
    cut = api.ok(max_tokens=16, stop=[word])["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == word
    assert full.startswith(api.text(max_tokens=16, stop=word)) and word not in api.text(max_tokens=16, stop=word)


def check_stop_token_ids(api):
    ids = api.token_ids()
    out = api.ok(stop_token_ids=[ids[2]])
    assert out["usage"]["completion_tokens"] == 3 and out["choices"][0]["stop_reason"] == ids[2]


def _penalised(api, **kw):
    assert api.text(max_tokens=48) != api.text(max_tokens=48, **kw)


def check_presence_penalty(api):
    _penalised(api, presence_penalty=2.0)


def check_frequency_penalty(api):
    _penalised(api, frequency_penalty=2.0)


def check_repetition_penalty(api):
    _penalised(api, repetition_penalty=2.0)


def check_logit_bias(api):
    ids = api.token_ids()
    assert api.token_ids(logit_bias={str(ids[0]): -100})[0] != ids[0]      # banned
    assert api.token_ids(logit_bias={"300": 100})[:3] == [300] * 3         # all but forced
    api.refused("logit_bias", logit_bias={"abc": 1})
    api.refused("logit_bias", logit_bias={"5": 100.5})
    assert api.refused("logit_bias", logit_bias={"99999": 1})["code"] == "engine_rejected"    # vocabulary: 512


def check_min_tokens(api):
    assert api.ok(logit_bias={str(EOS): 100})["usage"]["completion_tokens"] == 1     # EOS at once
    assert api.ok(logit_bias={str(EOS): 100}, min_tokens=4)["usage"]["completion_tokens"] == 5    # 4, then EOS


def check_ignore_eos(api):
    out = api.ok(logit_bias={str(EOS): 100}, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"


def check_skip_special_tokens(api):
    kw = {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3}
    assert "</s>" not in api.text(**kw)
    assert api.text(skip_special_tokens=False, **kw) == "</s>" * 3


def check_include_stop_str_in_output(api):
    word = api.text(max_tokens=16).split()[2]
    assert api.text(max_tokens=16, stop=word, include_stop_str_in_output=True).endswith(word)


def check_stream(api):
    events = api.stream_events()
    pieces = [(c["delta"].get("content") or "") if api.endpoint == "chat" else c["text"]
              for e in events for c in e["choices"]]
    assert "".join(pieces) == api.text() and len(events) > 1


def check_stream_options(api):
    events = api.stream_events(stream_options={"include_usage": True})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert all("usage" not in e for e in events[:-1])
    running = api.stream_events(stream_options={"continuous_usage_stats": True})
    counts = [e["usage"]["completion_tokens"] for e in running]
    assert counts == sorted(counts) and counts[-1] == 8


def check_priority(api):      # this server schedules fcfs: a priority would be ignored, so it is refused
    api.ok(priority=0)
    assert api.refused("priority", priority=1)["code"] == "priority_not_supported"


def check_prompt_logprobs(api):
    out = api.ok(prompt_logprobs=2, max_tokens=1)
    table = out["prompt_logprobs"] if api.endpoint == "chat" else out["choices"][0]["prompt_logprobs"]
    assert len(table) == out["usage"]["prompt_tokens"] and table[0] is None
    assert all(1 <= len(t) <= 3 and all(v["rank"] >= 1 and v["logprob"] <= 0 for v in t.values()) for t in table[1:])
    api.refused("prompt_logprobs", prompt_logprobs=1, stream=True)


def check_return_tokens_as_token_ids(api):
    assert all(isinstance(t, int) for t in api.token_ids())


def check_user(api, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        api.ok(user="alice-7")
    assert any("alice-7" in r.getMessage() for r in caplog.records), "the request log line names the user"


# ------------------------------------------------------------------ chat's own

def check_messages(api):
    assert api.text(messages=[{"role": "user", "content": "Hello"}]) != api.text()


def check_max_tokens(api):
    assert api.ok(max_tokens=5)["usage"]["completion_tokens"] == 5


def check_max_completion_tokens(api):
    assert api.ok(max_tokens=None, max_completion_tokens=3)["usage"]["completion_tokens"] == 3


def check_logprobs(api):
    assert api.ok()["choices"][0]["logprobs"] is None
    assert len(api.ok(logprobs=True)["choices"][0]["logprobs"]["content"]) == 8


def check_top_logprobs(api):
    content = api.ok(logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(t["top_logprobs"]) == 3 for t in content)


def check_add_generation_prompt(api):
    with_prompt, without = api.ok()["usage"]["prompt_tokens"], api.ok(add_generation_prompt=False)["usage"]["prompt_tokens"]
    assert with_prompt > without


def _history(api):
    return [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]


def check_continue_final_message(api):
    cont = api.ok(messages=_history(api), continue_final_message=True, add_generation_prompt=False)
    closed = api.ok(messages=_history(api), add_generation_prompt=False)
    assert cont["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]    # no newline after the turn
    assert api.client.post("/v1/completions", json={"prompt": "user: Tell a story\nassistant: Once upon",
                                                    "max_tokens": 8, "temperature": 0,
                                                    "add_special_tokens": False}).json()["choices"][0]["text"] \
        == cont["choices"][0]["message"]["content"]
    api.refused("continue_final_message", messages=_history(api), continue_final_message=True)


def check_echo(api):
    answer = api.ok(messages=_history(api), continue_final_message=True, add_generation_prompt=False)
    echoed = api.ok(messages=_history(api), continue_final_message=True, add_generation_prompt=False, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "Once upon" + answer["choices"][0]["message"]["content"]
    streamed = api.stream_events(messages=_history(api), continue_final_message=True, add_generation_prompt=False,
                                 echo=True)
    assert "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"]) == \
        echoed["choices"][0]["message"]["content"]
    assert api.text(echo=True) == api.text()        # the last message is the user's: nothing to echo


def check_chat_template_kwargs(api):
    thinking = api.ok(chat_template_kwargs={"think": True})["usage"]["prompt_tokens"]
    assert thinking > api.ok(chat_template_kwargs={"think": False})["usage"]["prompt_tokens"]
    # a variable the template does not read is left out, as vLLM does, and named in the header
    r = api.post(chat_template_kwargs={"think": True, "enable_thinking": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == thinking
    assert r.headers[IGNORED_FIELDS_HEADER] == "chat_template_kwargs.enable_thinking"
    assert IGNORED_FIELDS_HEADER not in api.post(chat_template_kwargs={"think": True}).headers
    api.refused("chat_template_kwargs", chat_template_kwargs={"messages": []})     # the renderer's own


def check_add_special_tokens(api):
    # A model's template is expected to write its BOS itself, so by default none is added
    # (chat_template.py); true: the tokenizer's BOS too.
    default, with_bos = api.ok(), api.ok(add_special_tokens=True)
    assert with_bos["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"] + 1
    assert api.ok(add_special_tokens=False)["usage"]["prompt_tokens"] == default["usage"]["prompt_tokens"]


# ------------------------------------------------------------------ vLLM's and llama-server's

def _beams(api, **kw) -> list[str]:
    out = api.ok(use_beam_search=True, **kw)["choices"]
    return [c["message"]["content"] if api.endpoint == "chat" else c["text"] for c in out]


def check_use_beam_search(api):
    beams = _beams(api, n=2, max_tokens=16, temperature=1.0)       # beams rank raw logprobs: no draws
    assert len(beams) == 2 and beams[0] != beams[1]
    assert beams == _beams(api, n=2, max_tokens=16, temperature=1.0)
    assert beams[0] != api.text(n=2, max_tokens=16, temperature=1.0, seed=3) or beams[1] != api.text(
        n=2, max_tokens=16, temperature=1.0, seed=4)
    api.refused("use_beam_search", use_beam_search=True, n=2, stream=True)
    api.refused("use_beam_search", use_beam_search=True, n=2, top_p=0.5)


def check_length_penalty(api):
    stop = api.token_ids(max_tokens=16)[2]       # beams end at different lengths
    short, long = (_beams(api, n=4, max_tokens=24, stop_token_ids=[stop], length_penalty=lp)[0] for lp in (-10, 10))
    assert len(short) < len(long)
    assert api.refused("length_penalty", length_penalty=2.0)["param"] == "length_penalty"    # no beams: vLLM's rule


def check_bad_words(api):
    greedy = api.text(max_tokens=16)
    word = greedy.split()[3]
    banned = api.text(max_tokens=16, bad_words=[word])
    assert word not in banned.split() and banned != greedy
    assert greedy.startswith(banned[:len(greedy.split(word)[0])])      # the same up to the word
    api.refused("bad_words", bad_words=[""])


def check_allowed_token_ids(api):
    ids = api.token_ids(max_tokens=16)
    allowed = [ids[1], ids[4], 300]
    assert all(set(api.token_ids(max_tokens=16, allowed_token_ids=allowed, temperature=1.0, seed=s)) <= set(allowed)
               for s in range(3))
    kept = api.token_ids(max_tokens=4, allowed_token_ids=[ids[0], 300])    # the best first token is allowed
    assert kept[0] == ids[0] and set(kept) <= {ids[0], 300}
    assert api.refused("allowed_token_ids", allowed_token_ids=[5, 99999])["code"] == "engine_rejected"
    api.refused("allowed_token_ids", allowed_token_ids=[])


def check_truncate_prompt_tokens(api):
    full = api.ok(max_tokens=1)["usage"]["prompt_tokens"]
    out = api.ok(truncate_prompt_tokens=3)
    assert out["usage"]["prompt_tokens"] == 3 < full
    assert api.ok(truncate_prompt_tokens=full + 5)["usage"]["prompt_tokens"] == full
    if api.endpoint == "completions":
        ids = api.client.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
        assert out["choices"][0]["text"] == api.text(prompt=ids[-3:])
        assert api.text(truncate_prompt_tokens=3, echo=True).startswith(api.client.post(
            "/detokenize", json={"tokens": ids[-3:]}).json()["prompt"])
    api.refused("truncate_prompt_tokens", truncate_prompt_tokens=0)
    api.refused("truncate_prompt_tokens", truncate_prompt_tokens=10**6)      # over max_model_len


def check_spaces_between_special_tokens(api):
    kw = {"logit_bias": {str(EOS): 100}, "ignore_eos": True, "max_tokens": 3, "skip_special_tokens": False}
    assert api.text(spaces_between_special_tokens=False, **kw) == "</s>" * 3
    api.refused("spaces_between_special_tokens", spaces_between_special_tokens=True, **kw)
    assert api.text(spaces_between_special_tokens=True, max_tokens=3) == api.text(max_tokens=3)   # skipped anyway


def check_request_id(api, caplog):
    prefix = "chatcmpl-" if api.endpoint == "chat" else "cmpl-"
    with caplog.at_level(logging.INFO, logger="kvserve"):
        r = api.post(request_id="my-req.7")
    assert r.status_code == 200 and r.json()["id"] == prefix + "my-req.7" and r.headers["x-request-id"] == "my-req.7"
    assert any(f"{prefix}my-req.7" in rec.getMessage() for rec in caplog.records if rec.name == "kvserve.requests")
    path = "/v1/chat/completions" if api.endpoint == "chat" else "/v1/completions"
    r = api.client.post(path, json=api.body(request_id="body-id"), headers={"X-Request-Id": "header-id"})
    assert r.json()["id"] == prefix + "header-id" and r.headers["x-request-id"] == "header-id"    # vLLM's order
    r = api.client.post(path, json=api.body(stream=True, request_id="s1"))
    assert r.headers["x-request-id"] == "s1" and f'"id":"{prefix}s1"' in r.text
    assert "x-request-id" not in api.post().headers
    api.refused("request_id", request_id="a b")


def check_n_predict(api):
    path = "/v1/chat/completions" if api.endpoint == "chat" else "/v1/completions"
    alone = lambda **kw: api.client.post(path, json={k: v for k, v in api.body(**kw).items() if k != "max_tokens"})  # noqa: E731
    assert alone(n_predict=3).json()["usage"]["completion_tokens"] == 3
    assert api.ok(n_predict=8)["usage"]["completion_tokens"] == 8          # the same as max_tokens: fine
    assert api.refused("n_predict", n_predict=3)["param"] == "n_predict"    # max_tokens 8 given too
    eos = alone(n_predict=-1, logit_bias={str(EOS): 100}, min_tokens=2).json()
    assert eos["usage"]["completion_tokens"] == 3                # -1: no limit but the context's
    api.refused("n_predict", n_predict=-2)


def check_repeat_penalty(api):
    assert api.text(max_tokens=48, repeat_penalty=2.0) == api.text(max_tokens=48, repetition_penalty=2.0)
    _penalised(api, repeat_penalty=2.0)
    api.refused("repeat_penalty", repeat_penalty=2.0, repetition_penalty=1.5)


def check_typical_p(api):        # a mass this small keeps only the most typical token: no draw is left
    texts = {api.text(max_tokens=16, temperature=1.0, seed=s, typical_p=1e-6) for s in range(3)}
    assert len(texts) == 1
    assert _sampled_differs(api, typical_p=1.0)
    api.refused("typical_p", typical_p=0.0)


def check_n_probs(api):
    out = api.ok(n_probs=2)["choices"][0]["logprobs"]
    if api.endpoint == "chat":
        assert len(out["content"]) == 8 and all(len(t["top_logprobs"]) == 2 for t in out["content"])
        api.refused("n_probs", n_probs=2, logprobs=False)
    else:
        assert len(out["tokens"]) == 8 and all(len(t) == 2 for t in out["top_logprobs"])
        api.refused("n_probs", n_probs=2, logprobs=3)
    assert api.ok(n_probs=0)["choices"][0]["logprobs"] is None


def check_samplers(api):
    assert api.text(samplers=["penalties", "temperature", "top_k", "top_p", "min_p", "typ_p"]) == api.text()
    assert api.text(samplers="etkpmy") == api.text()
    api.refused("samplers", samplers=["top_k", "temperature"])
    api.refused("samplers", samplers="kt")


def _long_prompt(api) -> dict:
    text = "Once upon a time there was a little girl named Lily. She liked to play in the park with her friends"
    return {"messages": [{"role": "user", "content": text}]} if api.endpoint == "chat" else {"prompt": text}


def check_cache_prompt(api):     # false: a salt of its own, so no prefix-cache block is shared
    cached = lambda **kw: api.ok(max_tokens=2, **_long_prompt(api), **kw)["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    cached()
    assert cached() > 0 and cached(cache_prompt=True) > 0
    assert cached(cache_prompt=False) == 0
    assert api.text(cache_prompt=False) == api.text()


def check_mirostat(api):
    api.ok(mirostat=0)
    assert api.refused("mirostat", mirostat=2)["param"] == "mirostat"


def check_dry_multiplier(api):
    api.ok(dry_multiplier=0)
    assert api.refused("dry_multiplier", dry_multiplier=0.8)["param"] == "dry_multiplier"


def check_id_slot(api):
    api.ok(id_slot=-1)
    assert api.refused("id_slot", id_slot=0)["param"] == "id_slot"


DOCS_TEMPLATE = ("{% for d in documents %}[{{ d.title }}] {{ d.text }}\\n{% endfor %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\\n{% endfor %}Assistant:")


def check_chat_template(api):
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = api.ok(chat_template=plain, add_generation_prompt=False)
    assert out["choices"][0]["message"]["content"] == api.client.post("/v1/completions", json={
        "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "add_special_tokens": False}).json()["choices"][0]["text"]
    assert out["usage"]["prompt_tokens"] < api.ok()["usage"]["prompt_tokens"]
    assert api.refused("chat_template", chat_template="{% for %}")["code"] == "chat_template_error"
    assert api.ok(chat_template="/etc/passwd")["usage"]["prompt_tokens"] < 16    # its text, never a file read


def check_documents(api):
    docs = [{"title": "Lily", "text": "Lily has a red ball."}]
    without = api.ok(chat_template=DOCS_TEMPLATE, documents=[])["usage"]["prompt_tokens"]
    assert api.ok(chat_template=DOCS_TEMPLATE, documents=docs)["usage"]["prompt_tokens"] > without
    assert api.refused("documents", documents=docs)["code"] == "chat_template_error"     # this template reads none


def check_kv_transfer_params(api):
    # a server that streams no KV refuses both sides' params (honoured: tests/fleet/test_pd_stream.py)
    api.refused("kv_transfer_params", kv_transfer_params={"transfer_id": "t"})
    api.refused("kv_transfer_params", kv_transfer_params={"transfer_id": "t", "stream_to": "127.0.0.1:9"})


def refused(param, value):
    def check(api):
        api.refused(param, **{param: value})
    return check


# ------------------------------------------------------------------ completions' own

def check_prompt(api):
    assert api.text(prompt="Hello") != api.text() and api.text(prompt=[1, 403, 407]) == api.text(prompt="Once upon")


def check_completion_logprobs(api):
    lp = api.ok(logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 8 and all(len(t) >= 2 for t in lp["top_logprobs"])


def check_completion_echo(api):
    assert api.text(echo=True) == "Once upon a time" + api.text()


def check_completion_add_special_tokens(api):
    assert api.ok()["usage"]["prompt_tokens"] == api.ok(add_special_tokens=False)["usage"]["prompt_tokens"] + 1


# Fields whose behaviour a test elsewhere checks (that test must exist).
ELSEWHERE = {
    "cache_salt": "tests/server/test_tenants.py::test_tenant_scopes_the_prefix_cache",
    "semantic_cache": "tests/server/test_tenants.py::test_semantic_cache",
    "response_format": "tests/server/test_structured_api.py::test_json_schema_response_format_validates_streamed_and_not",
    "structured_outputs": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "guided_json": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "guided_regex": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "guided_choice": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "guided_grammar": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "json_schema": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "grammar": "tests/server/test_structured_api.py::test_every_constraint_field_on_completions_and_chat",
    "tools": "tests/server/test_tool_calls_api.py::test_auto_reads_a_tool_call_the_model_wrote",
    "tool_choice": "tests/server/test_tool_calls_api.py::test_forced_calls_validate_streamed_and_not",
    "parallel_tool_calls": "tests/server/test_tool_calls_api.py::test_parallel_calls_run_until_the_model_closes_the_list",
}

SHARED = {name: globals()[f"check_{name}"] for name in (
    "model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "stream", "stream_options", "priority",
    "prompt_logprobs", "return_tokens_as_token_ids", "user",
    "use_beam_search", "length_penalty", "bad_words", "allowed_token_ids", "truncate_prompt_tokens",
    "spaces_between_special_tokens", "request_id", "n_predict", "repeat_penalty", "typical_p", "n_probs",
    "samplers", "cache_prompt", "mirostat", "dry_multiplier", "id_slot", "kv_transfer_params")}
CHAT = {**SHARED, **{name: globals()[f"check_{name}"] for name in (
    "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
    "continue_final_message", "echo", "chat_template_kwargs", "add_special_tokens", "chat_template", "documents")},
    "functions": refused("functions", [{"name": "f", "parameters": {}}]),
    "function_call": refused("function_call", "auto"),
    "audio": refused("audio", {"voice": "alloy", "format": "wav"}),
    "modalities": refused("modalities", ["text", "audio"]),
    "prediction": refused("prediction", {"type": "content", "content": "x"}),
    "web_search_options": refused("web_search_options", {}),
    "reasoning_effort": refused("reasoning_effort", "low")}
COMPLETIONS = {**SHARED, "prompt": check_prompt, "max_tokens": check_max_tokens, "logprobs": check_completion_logprobs,
               "echo": check_completion_echo, "add_special_tokens": check_completion_add_special_tokens,
               "best_of": refused("best_of", 2), "suffix": refused("suffix", "the end")}
MODELS = {"chat": (ChatCompletionRequest, CHAT), "completions": (CompletionRequest, COMPLETIONS)}


@pytest.mark.parametrize("endpoint", MODELS)
def test_every_field_has_a_check(endpoint):
    model, checks = MODELS[endpoint]
    missing = sorted(set(model.model_fields) - set(checks) - set(ELSEWHERE))
    assert not missing, f"{endpoint} fields with no behavioural check and no refusal: {missing}"
    for node in ELSEWHERE.values():
        path, name = node.split("::")
        assert f"def {name}(" in (TESTS.parent / path).read_text(), f"{node} does not exist"


@pytest.mark.parametrize("endpoint,field", [(e, f) for e, (_, checks) in MODELS.items() for f in sorted(checks)])
def test_field_is_honoured_or_refused(app, endpoint, field, caplog):
    check = MODELS[endpoint][1][field]
    api = Api(app, endpoint)
    check(api, caplog) if field in ("user", "request_id") else check(api)


@pytest.mark.parametrize("endpoint", MODELS)
def test_unknown_fields_are_named_in_the_log_and_a_header(app, endpoint, caplog):
    api = Api(app, endpoint)
    with caplog.at_level(logging.WARNING, logger="kvserve.server"):
        r = api.post(store=True, some_new_field={"x": 1})
    assert r.status_code == 200
    assert r.headers[IGNORED_FIELDS_HEADER] == "store, some_new_field"
    assert any("some_new_field" in rec.getMessage() for rec in caplog.records)
    assert IGNORED_FIELDS_HEADER not in api.post().headers
    if endpoint == "chat":
        r = api.post(messages=[{"role": "user", "content": "Hi", "weight": 1}])
        assert r.headers[IGNORED_FIELDS_HEADER] == "messages[0].weight"
    r = api.post(**{"bad\r\nX-Injected": 1, "é": 2, "": 3, " x ": 4})    # header-safe: escaped, never split
    assert r.status_code == 200 and "x-injected" not in r.headers
    assert r.headers[IGNORED_FIELDS_HEADER] == 'bad\\r\\nX-Injected, \\u00e9, "", " x "'


def test_tool_history_reaches_the_prompt(app):
    """An assistant's tool calls and the tool's answer in the history are rendered (kvserve's tool
    prompt on a template without tools), so the prompt grows with them."""
    api = Api(app, "chat")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    base = [{"role": "user", "content": "Weather in Paris?"}]
    with_calls = base + [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
    n0 = api.ok(messages=base)["usage"]["prompt_tokens"]
    n1 = api.ok(messages=with_calls)["usage"]["prompt_tokens"]
    n2 = api.ok(messages=base + [with_calls[1]])["usage"]["prompt_tokens"]
    assert n1 > n2 > n0


# The request fields vLLM's and llama-server's OpenAI-compatible endpoints document that issue 35
# names, with a value each: every one is a field of the request models (honoured or refused
# above), never an unknown one.
VLLM_AND_LLAMA = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": ["dragon"], "allowed_token_ids": None,
                  "truncate_prompt_tokens": None, "spaces_between_special_tokens": True, "request_id": "r-1",
                  "n_predict": 8, "repeat_penalty": 1.0, "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0,
                  "n_probs": 0, "samplers": ["penalties", "temperature", "top_k", "top_p", "min_p", "typ_p"],
                  "cache_prompt": True, "id_slot": -1}


@pytest.mark.parametrize("endpoint", MODELS)
def test_no_vllm_or_llama_field_is_ignored(app, endpoint):
    api = Api(app, endpoint)
    fields = {**VLLM_AND_LLAMA, **({"chat_template": THINKING_TEMPLATE, "documents": None} if endpoint == "chat" else {})}
    r = api.post(**fields)
    assert r.status_code == 200, r.text
    assert IGNORED_FIELDS_HEADER not in r.headers
    assert api.text(**fields) == api.text()          # every value above is the field's "off" one


@pytest.mark.parametrize("endpoint", MODELS)
def test_llama_server_json_object_schema_constrains(app, endpoint):
    """llama-server's `response_format: {"type": "json_object", "schema": ...}`: the schema, not any object."""
    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}}, "required": ["pet"],
              "additionalProperties": False}
    api = Api(app, endpoint)
    text = api.text(max_tokens=32, response_format={"type": "json_object", "schema": schema})
    assert json.loads(text)["pet"] in ("cat", "dog") and set(json.loads(text)) == {"pet"}
