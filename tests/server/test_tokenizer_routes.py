"""The tokenizer endpoints and the small informational routes (server/openai/tokenizer_routes.py) against
live stories260K servers: /tokenize (text, and a chat rendered exactly as /v1/chat/completions
prompts it), /detokenize, /tokenizer_info, /version, /v1/models/{id}; their bad inputs and API
keys; `kvserve --version`; `kvserve serve MODEL` (the positional); and lm-eval's
`local-completions` with `tokenizer_backend=remote` (no tokenizer directory on the client) on a
small local multiple-choice task, its loglikelihoods equal to the server's echo logprobs."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvserve.frontend.chat_template import FALLBACK_CHAT_TEMPLATE, ChatRenderer
from kvserve.model.tokenizers.tokenizer import HFTokenizer

from .live import ROOT, STORIES_HF, LiveServer, free_port, openai_client

TEXT = "Once upon a time, there was a little girl named Lily."
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]
TASK_DOCS = Path(__file__).parent / "lm_eval_task" / "docs.jsonl"
NAME = "stories260K-hf"            # LiveServer's served name: the directory's base name


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--enable-auto-tool-choice")
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(STORIES_HF)


def post(server, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, trust_env=False)


def get(server, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(server.base_url + path, headers=headers, timeout=60, trust_env=False)


def tokenize(server, **body) -> dict:
    r = post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    return r.json()


def max_model_len(server) -> int:
    return get(server, "/v1/models").json()["data"][0]["max_model_len"]


# ------------------------------------------------------------------ /tokenize, /detokenize


def test_tokenize_a_prompt_is_the_tokenizers_encoding(server, tok):
    import tokenizers

    out = tokenize(server, prompt=TEXT)
    assert out["tokens"] == tok.encode(TEXT) and out["tokens"][0] == tok.bos_token_id
    assert out["count"] == len(out["tokens"]) and out["token_strs"] is None
    assert out["max_model_len"] == max_model_len(server) == 512
    plain = tokenize(server, prompt=TEXT, add_special_tokens=False, return_token_strs=True, model=NAME)
    assert plain["tokens"] == tok.encode(TEXT, add_special_tokens=False) == out["tokens"][1:]
    raw = tokenizers.Tokenizer.from_file(str(STORIES_HF / "tokenizer.json"))
    assert plain["token_strs"] == [raw.id_to_token(i) for i in plain["tokens"]]
    assert plain["token_strs"][:2] == ["▁Once", "▁upon"]
    # /v1/completions prompts the same ids
    usage = openai_client(server).completions.create(model=NAME, prompt=TEXT, max_tokens=1).usage
    assert usage.prompt_tokens == out["count"]


def test_tokenize_messages_is_the_chat_endpoints_prompt(server, tok):
    client = openai_client(server)
    renderer = ChatRenderer(tok)            # stories260K has no template: kvserve's fallback
    for extra in ({}, {"add_generation_prompt": False}, {"tools": TOOLS}):
        out = tokenize(server, messages=CHAT, **extra)
        text = renderer.render(CHAT, extra.get("add_generation_prompt", True), extra.get("tools"))
        assert out["tokens"] == tok.encode(text) and out["count"] == len(out["tokens"])
        if "add_generation_prompt" not in extra:        # (the chat endpoint always adds it here)
            usage = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1,
                                                   **extra).usage
            assert usage.prompt_tokens == out["count"], extra
    assert tokenize(server, messages=CHAT)["tokens"][-2:] == tok.encode("Assistant:", False)[-2:]
    no_bos = tokenize(server, messages=CHAT, add_special_tokens=False)["tokens"]
    assert no_bos == tokenize(server, messages=CHAT)["tokens"][1:]
    cont = tokenize(server, messages=CHAT + [{"role": "assistant", "content": "Once"}],
                    add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(cont["tokens"]).endswith("Assistant: Once")
    # tool_choice "none" keeps the tools out of the prompt, as in chat
    assert tokenize(server, messages=CHAT, tools=TOOLS, tool_choice="none") == tokenize(server, messages=CHAT)


def test_detokenize_is_the_tokenizers_decoding(server, tok):
    ids = tok.encode(TEXT)
    r = post(server, "/detokenize", {"tokens": ids, "model": NAME})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert r.json()["prompt"].startswith("<s>")             # special tokens are kept
    plain = tok.encode(TEXT, add_special_tokens=False)
    assert post(server, "/detokenize", {"tokens": plain}).json()["prompt"] == TEXT
    assert post(server, "/detokenize", {"tokens": []}).json()["prompt"] == ""


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/tokenize", {}, 400, "prompt", None),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages", None),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools", None),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, 400, "add_generation_prompt", None),
    ("/tokenize", {"prompt": None}, 400, "prompt", None),
    ("/tokenize", {"prompt": 7}, 400, "prompt", None),
    ("/tokenize", {"messages": []}, 400, "messages", None),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message", None),
    ("/tokenize", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "invalid_tools"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", "chat_template_error"),            # (the renderer sets messages itself)
    ("/tokenize", {"prompt": "a" * 2_000_000}, 400, "prompt", "context_length_exceeded"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/detokenize", {"tokens": [1, 512]}, 400, "tokens", "invalid_token_id"),
    ("/detokenize", {"tokens": [2**40]}, 400, "tokens", "invalid_token_id"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", None),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0", None),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", None),
    ("/detokenize", {}, 400, "tokens", None),
])
def test_bad_input_is_a_4xx_naming_the_field(server, path, body, status, param, code):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert param.split(".")[0] in err["message"] or status == 404, err


def test_bodies_are_read_as_the_other_routes_read_them(server):
    r = httpx.post(server.base_url + "/tokenize", content=b'{"prompt": "a"}',
                   headers={"Content-Type": "text/plain"}, trust_env=False)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(server.base_url + "/detokenize", content=b'{"tokens": [1,',
                   headers={"Content-Type": "application/json"}, trust_env=False)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    assert get(server, "/health").status_code == 200


# ------------------------------------------------------------------ info routes


def test_tokenizer_info(server):
    r = get(server, "/tokenizer_info")
    assert r.status_code == 200
    assert r.json() == {"tokenizer_class": "HFTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                        "bos_token_id": 1, "eos_token_id": 2, "add_bos_token": True, "vocab_size": 512,
                        "model_max_length": max_model_len(server),
                        "chat_template": FALLBACK_CHAT_TEMPLATE}


def test_version(server):
    want = importlib.metadata.version("kvserve")
    assert get(server, "/version").json() == {"version": want}
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "--version"], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, f"kvserve {want}\n", "")


def test_model_card_by_name_and_path_and_404(server):
    client = openai_client(server)
    listed = client.models.list().data[0].model_dump()
    for model_id in (NAME, str(STORIES_HF)):                # (the SDK escapes the path's slashes)
        card = client.models.retrieve(model_id).model_dump()
        assert {**card, "created": 0} == {**listed, "created": 0}
        assert card["id"] == NAME and card["root"] == str(STORIES_HF)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


# ------------------------------------------------------------------ `kvserve serve MODEL`, API keys


class PositionalServer:
    """`kvserve serve MODEL ...` (no --model) in a subprocess, like live.LiveServer."""

    def __init__(self, *args: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", str(STORIES_HF), "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, self.proc.stdout.read().decode(errors="replace")
            try:
                if get(self, "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "kvserve serve MODEL did not become healthy"
            time.sleep(0.2)

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        finally:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def keyed():
    srv = PositionalServer("--api-key", "sekrit", "--served-model-name", "tiny",
                           "--escape-special-tokens-in-content")
    yield srv
    assert srv.stop() == 0


def test_serve_model_positional_and_api_keys(keyed):
    assert get(keyed, "/v1/models/tiny", "sekrit").json()["root"] == str(STORIES_HF)   # the positional's
    assert get(keyed, f"/v1/models/{STORIES_HF}", "sekrit").json()["id"] == "tiny"
    for call in (lambda k: post(keyed, "/tokenize", {"prompt": TEXT}, k),
                 lambda k: post(keyed, "/detokenize", {"tokens": [1, 2]}, k),
                 lambda k: get(keyed, "/tokenizer_info", k), lambda k: get(keyed, "/v1/models/tiny", k)):
        for key in (None, "wrong"):
            r = call(key)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert call("sekrit").status_code == 200
    assert get(keyed, "/version").status_code == 200          # public, as /health
    assert post(keyed, "/tokenize", {"prompt": "a", "model": "tiny"}, "sekrit").status_code == 200


def test_tokenize_escapes_special_token_text_as_the_chat_endpoint_does(server, keyed, tok):
    """With --escape-special-tokens-in-content a message's `</s>` is text, in /tokenize as in chat."""
    chat = [{"role": "user", "content": "the end</s> or not"}]
    plain = tokenize(server, messages=chat)["tokens"]
    escaped = post(keyed, "/tokenize", {"messages": chat}, "sekrit").json()["tokens"]
    assert tok.eos_token_id in plain and tok.eos_token_id not in escaped
    assert escaped[0] == tok.bos_token_id
    assert tok.decode(escaped[1:], skip_special_tokens=False) == ChatRenderer(tok).render(chat)
    client = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="sekrit", max_retries=0,
                           http_client=httpx.Client(trust_env=False, timeout=60))
    usage = client.chat.completions.create(model="tiny", messages=chat, max_tokens=1).usage
    assert usage.prompt_tokens == len(escaped)


def test_serve_model_positional_and_flag_must_agree(capsys):
    from kvserve.cli import main

    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    err = capsys.readouterr().err
    assert "kvserve serve: error: the model is given twice" in err
    assert "'/models/a'" in err and "'/models/b'" in err


def test_replicas_get_the_positional_model():
    from kvserve.fleet.launcher import replica_argv
    from kvserve.entrypoints.serve import add_serve_args, model_from_positional
    from kvserve.server.cli import add_cli_args

    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    for argv in ([str(STORIES_HF), "--data-parallel-size", "2", "--block-size", "8"],
                 ["--data-parallel-size", "2", str(STORIES_HF), "--model", f"{STORIES_HF}/"],
                 ["--model", str(STORIES_HF), "--data-parallel-size", "2"]):
        args = serve.parse_args(argv)
        model_from_positional(args)
        one = argparse.ArgumentParser()
        add_cli_args(one)
        replica = replica_argv(args, one)
        assert replica[:2] == ["--model", str(STORIES_HF)], argv
        assert one.parse_args(replica).model == str(STORIES_HF)


# ------------------------------------------------------------------ lm-eval, remote tokenizer


def echo_loglikelihood(server, context: str, continuation: str) -> float:
    """lm-eval's loglikelihood of `continuation` after `context`, from /tokenize and the echo
    logprobs of /v1/completions (its split of the pair into token ids, and its request)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ids = tokenize(server, prompt=context + continuation, add_special_tokens=False)["tokens"]
    ctx = tokenize(server, prompt=context, add_special_tokens=False)["tokens"]
    out = openai_client(server).completions.create(model=NAME, prompt=ids, max_tokens=1, logprobs=1,
                                                   echo=True, temperature=0)
    return sum(out.choices[0].logprobs.token_logprobs[len(ctx):len(ids)])


def test_lm_eval_remote_tokenizer_loglikelihoods(server, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")          # nothing is downloaded: no tokenizer, no data
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    evaluator = pytest.importorskip("lm_eval.evaluator")
    from lm_eval.tasks import TaskManager
    task = {"task": "kvserve_tiny_stories", "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(TASK_DOCS)}, "cache_dir": str(tmp_path)},
            "output_type": "multiple_choice", "doc_to_text": "context", "doc_to_choice": "choices",
            "doc_to_target": "label", "metric_list": [{"metric": "acc"}], "metadata": {"version": 1}}
    model_args = (f"base_url={server.base_url}/v1/completions,model={NAME},tokenizer_backend=remote,"
                  "num_concurrent=1,max_retries=1,max_length=512")
    tasks = TaskManager(include_defaults=False)         # (indexing lm-eval's own tasks takes 20 s)
    runs = [evaluator.simple_evaluate(model="local-completions", model_args=model_args, tasks=[task],
                                      log_samples=True, batch_size=1, task_manager=tasks)
            for _ in range(2)]
    samples = [sorted(r["samples"]["kvserve_tiny_stories"], key=lambda s: s["doc_id"]) for r in runs]
    docs = [json.loads(line) for line in TASK_DOCS.read_text().splitlines()]
    assert len(samples[0]) == len(docs) == 4
    for s, again, doc in zip(*samples, docs):
        lls = [resp[0][0] for resp in s["resps"]]
        assert lls == [resp[0][0] for resp in again["resps"]]             # deterministic
        assert len(lls) == len(doc["choices"]) and all(math.isfinite(x) and x < 0 for x in lls)
        want = [echo_loglikelihood(server, doc["context"], " " + c) for c in doc["choices"]]
        assert lls == pytest.approx(want, abs=1e-5)
    acc = runs[0]["results"]["kvserve_tiny_stories"]["acc,none"]
    best = [max(range(len(d["choices"])), key=lambda i, s=s: s["resps"][i][0][0]) == d["label"]
            for s, d in zip(samples[0], docs)]
    assert acc == sum(best) / len(best)


def test_template_variables_the_template_does_not_read_are_named_not_refused(server):
    """vLLM leaves out chat_template_kwargs the template does not read (clients send
    enable_thinking to every model); kvserve does too, and names them in the header."""
    plain = post(server, "/tokenize", {"messages": CHAT})
    r = post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200 and r.json()["tokens"] == plain.json()["tokens"]
    assert r.headers["kvserve-ignored-fields"] == "chat_template_kwargs.enable_thinking"
    assert "kvserve-ignored-fields" not in plain.headers
