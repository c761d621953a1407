"""--reasoning-parser (issue 35, item 4): a reasoning model's <think>...</think> apart from its
answer, streamed and not, in chat and the Responses API, with structured outputs applied only
after the thought. The splitter is checked against an independent reading of the whole text,
the grammar against llguidance, and the server on stories260K and on a tiny random Qwen3 whose
tokenizer has <think> and </think> as (non-special) tokens, pushed by logit_bias."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import llguidance as llg
import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine_core import EngineCore
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.server.app import build_app
from kvserve.server.openai.reasoning import REASONING_PARSERS, ReasoningSplitter
from kvserve.server.openai.tool_output import ChoiceOutput
from kvserve.structured.compiler import JSON_OPTIONS, ll_tokenizer
from kvserve.structured.reasoning_grammar import after_reasoning

from tests.conftest import build_random_model
from tests.server.live import STORIES_HF

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["n"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Once upon a time"}]


def reference_split(parser: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole text, read independently of the splitter."""
    opened = text.startswith("<think>")
    if parser == "qwen3" and not opened:
        return "", text
    body = text[len("<think>"):] if opened else text
    m = re.match(r"(?s)(.*?)</think>\s*(.*)", body)
    return (m.group(1), m.group(2)) if m else (body, "")


def split_in_pieces(parser: str, text: str, cuts: list[int]) -> tuple[str, str]:
    s = ReasoningSplitter(REASONING_PARSERS[parser])
    thought, answer, last = [], [], 0
    for cut in [*cuts, len(text)]:
        r, c = s.feed(text[last:cut])
        thought.append(r), answer.append(c)
        last = cut
    r, c = s.finish()
    return "".join(thought) + r, "".join(answer) + c


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_the_splitter_reads_any_cut_of_a_text_as_the_whole(parser):
    rng = random.Random(0)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "</thi", "{"]
    texts = ["<think>plan</think>\n\nanswer", "plan</think>answer", "answer only", "<think>unclosed",
             "<thi", "<think></think>", "</think></think>x", "  <think>x</think>y", ""]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(12))) for _ in range(400)]
    for text in texts:
        want = reference_split(parser, text)
        assert split_in_pieces(parser, text, []) == want, text
        for _ in range(5):
            cuts = sorted(rng.randrange(len(text) + 1) for _ in range(rng.randrange(4)))
            assert split_in_pieces(parser, text, cuts) == want, (text, cuts)


@pytest.mark.parametrize("parser, text, ok", [
    ("deepseek_r1", '<think>hmm, ok</think>\n\n{"n": 5}', True),
    ("deepseek_r1", 'x y</think> {"n": 12}', True),
    ("deepseek_r1", '{"n": 1}', False),                   # the prompt opened a thought: it must end
    ("deepseek_r1", 'a</think>{"n": "x"}', False),        # the answer keeps to the schema
    ("qwen3", '{"n": 1}', True),                          # no thought
    ("qwen3", '<think>a</think>{"n": 7}', True),
    ("qwen3", 'x</think>{"n": 7}', False),                # a thought only if the output opens one
    ("qwen3", '<think>a</think>b</think>{"n": 7}', False),    # the first </think> ends it
])
def test_the_constraint_starts_after_the_thought(parser, text, ok):
    llt = ll_tokenizer(HFTokenizer(STORIES_HF), 512, 2)
    grammar = after_reasoning(llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS), parser)
    m = llg.LLMatcher(llt, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    assert bool(m.consume_tokens(llt.tokenize_str(text)) and m.is_accepting()) == ok


def chat(client, **kw):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(client, **kw) -> tuple[str, str, str]:
    reasoning = content = ""
    finish = None
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": CHAT, "max_tokens": 12, "temperature": 0, "stream": True, **kw}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            reasoning += choice["delta"].get("reasoning_content") or ""
            content += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_stories_thought_is_the_plain_answer_under_deepseek_r1():
    """DeepSeek-R1's template opens the thought: stories260K never closes it, so its whole text is
    reasoning, the same text a server without the parser answers, streamed and not."""
    engine = EngineCore(EngineConfig(model=str(STORIES_HF)))
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE)) as plain_client:
        plain = chat(plain_client)["choices"][0]["message"]["content"]
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE, reasoning_parser="deepseek_r1")) as client:
        msg = chat(client)["choices"][0]
        assert msg["message"]["reasoning_content"] == plain and msg["message"]["content"] is None
        assert msg["finish_reason"] == "length"
        assert streamed(client) == (plain, "", "length")
        # qwen3: no <think> opens the output, so it is all content
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE, reasoning_parser="qwen3")) as client:
        m = chat(client)["choices"][0]["message"]
        assert (m["content"], m["reasoning_content"]) == (plain, None)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        build_app(engine, "m", reasoning_parser="o1")


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """A tiny random Qwen3 whose tokenizer has </think> (id 512) and <think> (513) as text tokens."""
    return build_random_model("qwen3", tmp_path_factory.mktemp("qwen3-think"), added_tokens=("</think>", "<think>"))


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_structured_output_after_the_thought(thinking_model, parser):
    """logit_bias pushes </think>: the thought ends at once, then the answer keeps to the schema
    (the bias cannot push </think> into it: the grammar masks it there) and the choice stops;
    streamed, the same split."""
    engine = EngineCore(EngineConfig(model=str(thinking_model)))
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    kw = dict(response_format=fmt, logit_bias={"512": 100}, max_tokens=40)
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE, reasoning_parser=parser)) as client:
        choice = chat(client, **kw)["choices"][0]
        msg = choice["message"]
        jsonschema.validate(json.loads(msg["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop" and not msg["reasoning_content"]
        assert streamed(client, **kw) == (msg["reasoning_content"] or "", msg["content"], "stop")


def test_responses_reasoning_items(tmp_path):
    """A thought stories260K never closes (deepseek_r1) is a reasoning item, streamed as
    response.reasoning_text.delta events; sent back as input it is accepted and left out."""
    engine = EngineCore(EngineConfig(model=str(STORIES_HF)))
    with TestClient(build_app(engine, "m", chat_template=TEMPLATE, reasoning_parser="deepseek_r1")) as client:
        body = {"input": "Once upon a time", "max_output_tokens": 10, "temperature": 0}
        resp = client.post("/v1/responses", json=body).json()
        (item,) = resp["output"]
        assert item["type"] == "reasoning" and item["content"][0]["type"] == "reasoning_text"
        text = item["content"][0]["text"]
        assert text and resp["status"] == "incomplete"
        deltas = []
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if event["type"] == "response.reasoning_text.delta":
                        deltas.append(event["delta"])
                    elif event["type"] == "response.reasoning_text.done":
                        assert event["text"] == text
        assert "".join(deltas) == text
        again = client.post("/v1/responses", json={**body, "input": [
            {"role": "user", "content": "Once upon a time"}, item, {"role": "user", "content": "More"}]})
        assert again.status_code == 200, again.text
        assert resp["usage"]["output_tokens_details"]["reasoning_tokens"] == resp["usage"]["output_tokens"] == 10
        with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            done = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")][-1]
        assert done["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 10


TOKEN_TEXT = {1: "<think>", 2: "plan", 3: " more", 4: "</", 5: "think>", 6: "\n\n", 7: "answer", 8: "</think>"}


@pytest.mark.parametrize("parser, ids, thought", [
    ("qwen3", [1, 2, 3, 8, 6, 7, 7], 4),         # <think>plan more</think>: 4 tokens
    ("qwen3", [1, 2, 4, 5, 7], 4),               # the end marker split over two tokens
    ("qwen3", [2, 3, 7], 0),                     # no thought opened
    ("qwen3", [1, 2, 3], 3),                     # a thought that never ends
    ("deepseek_r1", [2, 8, 7], 2),               # the prompt opened it
    ("deepseek_r1", [8, 7, 7], 1),
    ("deepseek_r1", [2, 3], 2),
])
@pytest.mark.parametrize("piece", [1, 2, 100])
def test_reasoning_tokens_count_the_thought(parser, ids, thought, piece):
    """usage's reasoning_tokens: the thought's tokens, markers included, however the answer's
    tokens arrive (one by one, in pairs, or as one whole message)."""
    def decode(t):
        return "".join(TOKEN_TEXT[i] for i in t)
    out = ChoiceOutput(reasoning=REASONING_PARSERS[parser], decode=decode)
    if piece == 100:
        out.message(decode(ids), "length", ids)
    else:
        for i in range(0, len(ids), piece):
            part = ids[i:i + piece]
            out.delta(decode(part), "length" if i + piece >= len(ids) else None, part)
    assert out.reasoning_tokens == thought
