"""llama-server's routes (server/llama_routes.py): /completion against /v1/completions on
stories260K (greedy text, token ids, n_probs, streaming), the fields it refuses, /infill's FIM
prompt on a stories260K copy whose tokenizer has FIM tokens (and its refusal without them),
/props, /slots and /ping. In process."""
from __future__ import annotations

import json
import math
import shutil

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.server.app import build_app

from .live import STORIES_HF

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(STORIES_HF), max_num_seqs=4)), "stories")) as c:
        yield c


def openai_greedy(c, prompt, n: int, **kw) -> dict:
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_greedy_equals_v1_completions(client):
    ref = openai_greedy(client, PROMPT, 12, logprobs=2)
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0,
                                         "return_tokens": True, "n_probs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = ref["choices"][0]
    assert body["content"] == choice["text"]
    assert body["tokens_predicted"] == ref["usage"]["completion_tokens"] == len(body["tokens"])
    assert body["tokens_evaluated"] == ref["usage"]["prompt_tokens"]
    assert body["stop"] is True and body["truncated"] is False and body["model"] == "stories"
    assert body["stop_type"] == ("limit" if choice["finish_reason"] == "length" else "eos")
    assert body["generation_settings"]["temperature"] == 0 and body["generation_settings"]["n_predict"] == 12
    t = body["timings"]
    assert t["predicted_n"] == body["tokens_predicted"] and t["prompt_n"] + body["tokens_cached"] == body["tokens_evaluated"]
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] >= 0
    # n_probs: the chosen tokens' ids and logprobs are /v1/completions' logprobs
    probs = body["completion_probabilities"]
    assert [p["id"] for p in probs] == body["tokens"]
    assert "".join(p["token"] for p in probs) == body["content"]
    for p, lp in zip(probs, choice["logprobs"]["token_logprobs"]):
        assert math.isclose(p["logprob"], lp, abs_tol=1e-5)
        assert len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["logprob"] >= p["top_logprobs"][1]["logprob"]
        assert p["logprob"] <= p["top_logprobs"][0]["logprob"] + 1e-6


def test_completion_token_id_prompt_and_stop_word(client):
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    greedy = client.post("/completion", json={"prompt": ids, "n_predict": 12, "temperature": 0}).json()
    assert greedy["content"] == openai_greedy(client, PROMPT, 12)["choices"][0]["text"]
    words = greedy["content"].split()
    assert len(words) >= 3
    stop = " " + words[2]
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 12, "temperature": 0, "stop": [stop]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == stop
    assert r["content"] == greedy["content"][:greedy["content"].index(stop)]


def test_completion_stream_chunks_join_to_the_answer(client):
    whole = client.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0}).json()
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in r.text
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    probs = client.post("/completion", json={"prompt": PROMPT, "n_predict": 10, "temperature": 0, "stream": True,
                                             "n_probs": 3, "return_tokens": True})
    chunks = [json.loads(line[len("data: "):]) for line in probs.text.splitlines() if line.startswith("data: ")]
    ids = [p["id"] for e in chunks[:-1] for p in e["completion_probabilities"]]
    assert ids == [t for e in chunks[:-1] for t in e["tokens"]] and len(ids) == whole["tokens_predicted"]
    assert all(len(p["top_logprobs"]) == 3 for e in chunks[:-1] for p in e["completion_probabilities"])
    last = events[-1]
    assert last["content"] == "" and last["tokens_predicted"] == whole["tokens_predicted"]
    assert last["stop_type"] == whole["stop_type"] and "timings" in last


def test_seeded_sampling_is_reproducible_and_cache_prompt_false_shares_nothing(client):
    body = {"prompt": " ".join([PROMPT] * 12), "n_predict": 8, "seed": 7, "temperature": 1.0, "top_k": 0}
    a, b = (client.post("/completion", json=body).json() for _ in range(2))
    assert a["content"] == b["content"]
    assert b["tokens_cached"] > 0 and b["timings"]["prompt_n"] == b["tokens_evaluated"] - b["tokens_cached"]
    assert a["generation_settings"]["seed"] == 7 and a["generation_settings"]["top_k"] == 0
    again = client.post("/completion", json={**body, "cache_prompt": False}).json()
    assert again["tokens_cached"] == 0 and again["content"] == a["content"]


def test_llama_defaults_apply_and_props_shows_them(client):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()
    props = client.get("/props").json()
    params = props["default_generation_settings"]["params"]
    for name, value in (("temperature", 0.8), ("top_k", 40), ("top_p", 0.95), ("min_p", 0.05)):
        assert params[name] == value
        assert r["generation_settings"][name] == pytest.approx(value)
    assert props["total_slots"] == 4
    assert props["default_generation_settings"]["n_ctx"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert props["model_path"] == str(STORIES_HF)
    assert props["bos_token"] == "<s>" and props["eos_token"] == "</s>"
    assert isinstance(props["chat_template"], str)


@pytest.mark.parametrize("field, value", [
    ("mirostat", 2), ("dry_multiplier", 0.8), ("xtc_probability", 0.5), ("typical_p", 0.9),
    ("dynatemp_range", 0.5), ("top_n_sigma", 1.0), ("presence_penalty", 0.5), ("n_keep", 10),
    ("samplers", ["top_k", "temperature"]), ("lora", [{"id": 0, "scale": 1.0}]), ("grammar_lazy", True),
    ("grammar_triggers", [{"type": "word", "value": "x"}]), ("id_slot", 1), ("post_sampling_probs", True),
    ("n_predict", 0), ("image_data", [{"data": "", "id": 1}]),
])
def test_unbuilt_fields_are_refused_naming_them(client, field, value):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_neutral_values_of_unbuilt_fields_are_accepted(client):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "mirostat": 0, "mirostat_tau": 5.0,
                                         "dry_multiplier": 0.0, "typical_p": 1.0, "samplers": [], "id_slot": -1})
    assert r.status_code == 200, r.text


def test_repeat_penalty_needs_the_whole_window(client):
    r = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2, "repeat_penalty": 1.3})
    assert r.status_code == 400 and "repeat_last_n" in r.json()["error"]["message"]
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 0}
    ours = client.post("/completion", json={**body, "repeat_penalty": 1.3, "repeat_last_n": -1}).json()
    ref = openai_greedy(client, PROMPT, 10, repetition_penalty=1.3)
    assert ours["content"] == ref["choices"][0]["text"]


def test_a_list_of_prompts_is_refused(client):
    r = client.post("/completion", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_infill_without_fim_tokens_is_refused(client):
    r = client.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_task" and "fill-in-the-middle" in r.json()["error"]["message"]


def test_slots_and_ping(client):
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    assert all(s["n_ctx"] == slots[0]["n_ctx"] > 0 and s["is_processing"] is False for s in slots)   # idle
    assert client.get("/ping").json() == {"status": "ok"} and client.post("/ping").status_code == 200


def test_llama_server_writes_are_refused_as_it_refuses_them(client):
    """POST /props and POST /slots/ID?action=...: llama-server answers 501 not_supported_error
    without --props / --slot-save-path; kvserve has neither, so it always does, saying why."""
    r = client.post("/props", json={"n_ctx": 8})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert "fixed" in r.json()["error"]["message"]
    r = client.post("/slots/0?action=erase")
    assert r.status_code == 501 and r.json()["error"]["param"] == "action" and "'erase'" in r.json()["error"]["message"]


FIM = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


@pytest.fixture(scope="module")
def fim_dir(tmp_path_factory):
    """stories260K with three FIM special tokens: its tokenizer's added tokens and its embedding
    rows (transformers' resize_token_embeddings)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import LlamaForCausalLM

    out = tmp_path_factory.mktemp("stories-fim")
    model = LlamaForCausalLM.from_pretrained(str(STORIES_HF))
    tok = Tokenizer.from_file(str(STORIES_HF / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM])
    model.resize_token_embeddings(tok.get_vocab_size(with_added_tokens=True))
    model.save_pretrained(str(out))
    tok.save(str(out / "tokenizer.json"))
    shutil.copy(STORIES_HF / "tokenizer_config.json", out / "tokenizer_config.json")
    return out


def test_infill_builds_llama_servers_fim_prompt(fim_dir):
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(fim_dir / "tokenizer.json"))
    pre, suf, mid = (ref.token_to_id(t) for t in FIM)
    assert (pre, suf, mid) == (512, 513, 514)

    def ids(text):
        return ref.encode(text, add_special_tokens=False).ids

    prefix, suffix, middle = "Once upon a time, there was", " She was happy.", " a"
    expected = [1, pre] + ids(prefix) + [suf] + ids(suffix) + [mid] + ids(middle)
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(fim_dir))), "fim")) as c:
        r = c.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix, "prompt": middle,
                                    "n_predict": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens_evaluated"] == len(expected)
        assert body["prompt"].index("<fim_prefix>") < body["prompt"].index("<fim_suffix>") < body["prompt"].index("<fim_middle>")
        same = openai_greedy(c, expected, 8, ignore_eos=True)
        assert body["content"] == same["choices"][0]["text"] and body["tokens_predicted"] == 8
        r = c.post("/infill", json={"input_prefix": prefix, "input_extra": [{"filename": "a.py", "text": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra"


def test_the_routes_are_in_the_served_schema(client):
    import jsonschema_rs

    doc = client.get("/openapi.json").json()
    body = doc["paths"]["/completion"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema_rs.validator_for({**body, "components": doc["components"]})
    for case in ({"prompt": PROMPT, "mirostat": 2}, {"prompt": PROMPT, "repeat_penalty": 1.2},
                 {"prompt": PROMPT, "samplers": ["top_k"]}, {"prompt": PROMPT, "n_predict": 0},
                 {"prompt": PROMPT, "n_predict": 3}, {"prompt": PROMPT, "repeat_penalty": 1.2, "repeat_last_n": -1},
                 {"prompt": PROMPT, "repeat_penalty": None}):     # null: absent (the schema fuzz's find)
        served = client.post("/completion", json=case).status_code == 200
        assert validator.is_valid(case) == served, (case, served)
    assert "/infill" in doc["paths"] and "get" in doc["paths"]["/ping"]
    assert doc["paths"]["/completions"]["post"]["requestBody"] == doc["paths"]["/completion"]["post"]["requestBody"]
    alias = client.post("/completions", json={"prompt": PROMPT, "n_predict": 5, "temperature": 0}).json()
    assert alias["content"] == client.post("/completion", json={"prompt": PROMPT, "n_predict": 5,
                                                                "temperature": 0}).json()["content"]
    assert doc["paths"]["/props"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]


def test_infill_uses_a_gguf_files_fim_token_ids(tmp_path):
    """stories260K's GGUF with llama.cpp's tokenizer.ggml.fim_{pre,suf,mid}_token_id set (gguf-py's
    gguf_new_metadata): /infill builds its prompt around those ids."""
    import subprocess
    import sys

    src = STORIES_HF.parent / "stories260K" / "stories260K-f32.gguf"
    path = tmp_path / "stories-fim.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(src), str(path), "--force",
                    "--special-token-by-id", "fim_pre", "300", "--special-token-by-id", "fim_suf", "301",
                    "--special-token-by-id", "fim_mid", "302"], check=True, capture_output=True)
    with TestClient(build_app(LLMEngine(EngineConfig(model=str(path))), "gguf")) as c:
        def ids(text):
            return c.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        prefix, suffix = "Once upon a time", " The end."
        expected = [1, 300] + ids(prefix) + [301] + ids(suffix) + [302]
        r = c.post("/infill", json={"input_prefix": prefix, "input_suffix": suffix, "n_predict": 6,
                                    "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["tokens_evaluated"] == len(expected)
        assert r.json()["content"] == openai_greedy(c, expected, 6, ignore_eos=True)["choices"][0]["text"]
