"""The bench client measures what it claims: its random prompts are counted by the server at exactly
the requested length (issue 10), as token ids and as text, and a mismatch is reported loudly.

Live servers: stories260K (the llama2.c directory, whose GGUF holds the tokenizer) and a tiny copy
of benchmarks/common.py's benchmark model (same 32000-entry vocabulary and the same 512-piece
tokenizer, 2 layers of width 64): prompt lengths depend only on the tokenizer and the vocabulary,
and the ~100M model itself is checked by hand with benchmarks/bench_serve_llamacpp.py."""
from __future__ import annotations

import argparse
import json
import random

import pytest

from kvserve.bench.datasets import build_dataset
from kvserve.bench.prompts import fit_text, load_tokenizer
from kvserve.bench.report import format_summary, length_warning, summarize
from kvserve.bench.serve import RequestResult, add_cli_args

from tests.bench.test_bench_serve_live import bench
from tests.server.live import ROOT, STORIES_HF, LiveServer

STORIES_C = ROOT.parent / "shared" / "models" / "stories260K"


def _args(*argv):
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory):
    """benchmarks/common.py's TINY_MODEL_CONFIG model: the benchmark model's vocabulary and tokenizer."""
    from benchmarks.common import bench_model_dir

    return bench_model_dir(str(tmp_path_factory.mktemp("bench-llama-tiny")), tiny=True)


@pytest.mark.parametrize("source", [STORIES_HF, STORIES_C, STORIES_C / "stories260K-f32.gguf"])
def test_text_is_fitted_to_the_exact_length(source):
    tok, ordinary = load_tokenizer(str(source))
    assert tok is not None and 200 < len(ordinary) < 512
    # no specials, no byte pieces: every ordinary id decodes to text that is not a replacement char
    assert not set(ordinary) & set(tok.special_ids)
    assert all("\ufffd" not in tok.decode([i]) for i in ordinary)
    rng = random.Random(0)
    draw = lambda k: [rng.choice(ordinary) for _ in range(k)]  # noqa: E731
    for n in (2, 3, 17, 64, 128, 300):
        text, ok = fit_text(tok, draw, n)                       # a completion prompt: BOS counts
        assert ok and len(tok.encode(text)) == n, (n, text)
        text, ok = fit_text(tok, draw, n, with_specials=False)  # a chat message's content
        assert ok and len(tok.encode(text, add_special_tokens=False)) == n, (n, text)


def test_datasets_carry_token_ids_or_fitted_text(tiny_bench_model):
    common = ["--num-prompts", "12", "--random-input-len", "40", "--random-range-ratio", "0.5",
              "--tokenizer", str(tiny_bench_model)]
    convs = build_dataset(_args("--dataset-name", "random", *common))
    for c in convs:
        t = c.turns[0]
        assert t.exact_len and 20 <= t.prompt_len <= 60
        assert len(t.prompt_token_ids) == t.prompt_len and all(3 <= i < 512 for i in t.prompt_token_ids)
    tok, _ = load_tokenizer(str(tiny_bench_model))
    text_convs = build_dataset(_args("--dataset-name", "random", "--prompt-format", "text", *common))
    assert [c.turns[0].prompt_len for c in text_convs] == [c.turns[0].prompt_len for c in convs]
    for c in text_convs:
        t = c.turns[0]
        assert t.prompt_token_ids is None and len(tok.encode(t.text)) == t.prompt_len
    # on the chat endpoint the content is fitted, and the template's tokens are not the client's to count
    chat = build_dataset(_args("--dataset-name", "random", "--endpoint", "/v1/chat/completions", *common))
    for c in chat:
        t = c.turns[0]
        assert not t.exact_len and len(tok.encode(t.text, add_special_tokens=False)) == t.prompt_len
    prefix = build_dataset(_args("--dataset-name", "prefix", "--prefix-len", "16", "--prefix-question-len", "8",
                                 "--prefix-num-prefixes", "2", *common))
    ids = [c.turns[0].prompt_token_ids for c in prefix]
    assert all(len(x) == 24 for x in ids) and ids[0][:16] == ids[2][:16] != ids[1][:16]


def test_a_mismatch_is_reported_loudly():
    rs = [RequestResult(success=True, prompt_len=p, requested_prompt_len=128, exact_len=True, output_len=4,
                        ttft=0.1, itl=[0.01] * 3, e2e=0.13, start=0.0, usage_reported=True)
          for p in (128, 850, 128)]
    s = summarize(rs, 1.0)
    assert (s["total_input_tokens"], s["total_requested_input_tokens"]) == (1106, 384)
    assert s["prompt_len_mismatches"] == 1 and s["prompt_len_mismatch_examples"] == [(128, 850)]
    assert "WARNING: the server counted 1 of 3 prompts" in length_warning(s)
    assert "128 -> 850" in format_summary(s)
    assert length_warning(summarize(rs[::2], 1.0)) is None
    rs[0].usage_reported = False
    assert "reported no usage for 1 of 3" in length_warning(summarize(rs, 1.0))


def _served_prompt_lengths(server: LiveServer, tmp_path, *argv) -> tuple[dict, str]:
    out = tmp_path / "r.json"
    before = server.wait_idle()
    p = bench("--base-url", server.base_url, "--dataset-name", "random", "--random-output-len", "2",
              "--ignore-eos", "--save-result", str(out), "--save-detailed", *argv)
    assert p.returncode == 0, p.stdout + p.stderr
    after = server.wait_idle()
    [s] = json.loads(out.read_text())["runs"]["kvserve"]
    s["server_prompt_tokens"] = after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"]
    return s, p.stdout + p.stderr


def _assert_exact(s, n):
    reqs = s["requests"]
    assert s["completed"] == n and s["failed"] == 0
    for r in reqs:
        assert r["usage_reported"] and r["exact_len"]
        assert r["prompt_len"] == r["requested_prompt_len"], r        # usage.prompt_tokens == requested
    assert len({r["requested_prompt_len"] for r in reqs}) > 3          # --random-range-ratio varied them
    assert s["prompt_len_mismatches"] == 0
    assert s["total_input_tokens"] == s["total_requested_input_tokens"] == s["server_prompt_tokens"]


@pytest.mark.parametrize("model", ["stories260K", "tiny-bench-model"])
def test_server_counts_the_requested_prompt_lengths(model, tiny_bench_model, tmp_path):
    path = STORIES_C if model == "stories260K" else tiny_bench_model
    server = LiveServer("--model", str(path), "--max-model-len", "512")
    try:
        # the tokenizer from --tokenizer, or from --model given as a local .gguf path (whose served
        # name is then asked of /v1/models)
        source = (["--model", str(STORIES_C / "stories260K-f32.gguf")] if model == "stories260K"
                  else ["--tokenizer", str(path)])
        common = [*source, "--num-prompts", "10", "--random-input-len", "100",
                  "--random-range-ratio", "0.9", "--seed", "5"]
        s, log = _served_prompt_lengths(server, tmp_path, *common)
        assert "random token ids" in log and "WARNING" not in log
        _assert_exact(s, 10)
        s, log = _served_prompt_lengths(server, tmp_path, "--prompt-format", "text", *common)
        assert "text re-encoded" in log and "WARNING" not in log
        _assert_exact(s, 10)
        # Without a tokenizer the prompts are words, which this vocabulary spells out in far more
        # tokens: the server's counts are reported, with a warning on stderr.
        s, log = _served_prompt_lengths(server, tmp_path, "--num-prompts", "3", "--random-input-len", "20")
        assert s["prompt_len_mismatches"] == 3 and s["total_input_tokens"] > 3 * 20
        assert "WARNING: the server counted 3 of 3 prompts at another length" in log
    finally:
        assert server.stop() == 0, server.log()
