"""`LLM.chat` and `kvserve chat` on stories260K-hf, given an explicit chat template (the model has
none): chat equals generate on the rendered prompt, the CLI streams, keeps the history across
turns, and Ctrl-C aborts one answer without ending the session."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.entrypoints.chat import stream_answer
from kvserve.frontend.chat_template import ChatRenderer, ChatTemplateError
from tests.conftest import STORIES_HF
from tests.engine.pty_chat import PtyChat

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STRICT = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(STORIES_HF), num_kv_blocks=256)


def test_chat_equals_generate_on_the_rendered_prompt(llm):
    convs = [[{"role": "user", "content": "Once upon a time"}],
             [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "The cat"}]]
    outs = llm.chat(convs, GREEDY, chat_template=TEMPLATE)
    tok = llm.get_tokenizer()
    for conv, out in zip(convs, outs):
        text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}\n" for m in conv) + "<|assistant|>"
        # the template writes BOS itself, so the text is encoded without special tokens
        ids = tok.encode(text, add_special_tokens=False)
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        [ref] = llm.generate({"prompt_token_ids": ids}, GREEDY)
        assert out.prompt == text and out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids and len(ref.outputs[0].token_ids) > 0
    # one conversation (a list of dicts) gives a one-element list
    [single] = llm.chat(convs[0], GREEDY, chat_template=TEMPLATE)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_without_a_model_template_uses_the_fallback(llm):
    [out] = llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
    assert out.prompt == "User: Hi\nAssistant:"
    assert out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id


@pytest.mark.parametrize("messages", [[], "hello", [[{"role": "user", "content": "a"}], "b"]])
def test_chat_rejects_malformed_messages(llm, messages):
    with pytest.raises(ValueError, match="list of"):
        llm.chat(messages, GREEDY)


def test_template_refusal_is_a_value_error(llm):
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], GREEDY,
                 chat_template=STRICT)
    assert not llm.engine.has_unfinished_requests()


class Recorder(io.StringIO):
    """stdout stand-in that remembers each write, and can send SIGINT on the n-th one."""

    def __init__(self, interrupt_at: int | None = None):
        super().__init__()
        self.writes: list[str] = []
        self.interrupt_at = interrupt_at

    def write(self, s):
        self.writes.append(s)
        if len(self.writes) == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_stream_answer_streams_and_ctrl_c_aborts_only_that_answer(llm):
    renderer = ChatRenderer(llm.get_tokenizer(), TEMPLATE)
    text = renderer.render([{"role": "user", "content": "Once upon a time"}])
    prompt = {"prompt": text, "prompt_token_ids": renderer.encode(text)}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = Recorder()
    final, aborted = stream_answer(llm.engine, "s-1", prompt, params, out)
    assert not aborted and final.finished and len(final.outputs[0].token_ids) == 40
    assert len(out.writes) > 10 and out.getvalue() == final.outputs[0].text   # token by token
    handler = signal.getsignal(signal.SIGINT)
    cut = Recorder(interrupt_at=3)
    partial, aborted = stream_answer(llm.engine, "s-2", prompt, params, cut)
    assert aborted and not partial.finished and len(partial.outputs[0].token_ids) < 40
    assert not llm.engine.has_unfinished_requests()           # aborted, its blocks freed
    assert signal.getsignal(signal.SIGINT) is handler         # the caller's handler is back
    again, aborted = stream_answer(llm.engine, "s-3", prompt, params, Recorder())
    assert not aborted and again.outputs[0].token_ids == final.outputs[0].token_ids


def run_chat(*args: str, stdin: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", *args], input=stdin, cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def prompt_counts(stderr: str) -> list[int]:
    return [int(line[1:].split()[0]) for line in stderr.splitlines() if "prompt tokens" in line]


def test_cli_chat_over_stdin_keeps_the_history(llm):
    p = run_chat("--model", str(STORIES_HF), "--chat-template", TEMPLATE, "--temperature", "0",
                 "--max-tokens", "12", "--system", "Tell a story.", "--num-kv-blocks", "64",
                 stdin="Once upon a time\n\nThe cat\n/exit\nnever read\n")
    assert p.returncode == 0, p.stderr
    # the same conversation through LLM.chat, turn by turn
    history = [{"role": "system", "content": "Tell a story."}]
    answers, counts = [], []
    for line in ("Once upon a time", "The cat"):
        history.append({"role": "user", "content": line})
        [out] = llm.chat(history, GREEDY, chat_template=TEMPLATE)
        history.append({"role": "assistant", "content": out.outputs[0].text})
        answers.append(out.outputs[0].text)
        counts.append(len(out.prompt_token_ids))
    assert p.stdout == "".join(a + "\n" for a in answers)     # streamed answers, one per turn
    assert prompt_counts(p.stderr) == counts                  # the blank line is no turn
    # the second prompt holds the first exchange (its prompt and the answer's tokens)
    assert counts[1] > counts[0] + len(llm.get_tokenizer().encode(answers[0], add_special_tokens=False))


def test_cli_chat_reset_and_eof():
    p = run_chat("--model", str(STORIES_HF), "--chat-template", TEMPLATE, "--temperature", "0",
                 "--max-tokens", "4", "--num-kv-blocks", "64",
                 stdin="Once upon a time\n/reset\nOnce upon a time")   # no newline at the end
    assert p.returncode == 0, p.stderr
    first, second = prompt_counts(p.stderr)
    assert first == second                                    # /reset forgot the first exchange
    assert len(p.stdout.splitlines()) == 2


def test_cli_chat_in_a_terminal_ctrl_c_aborts_the_answer_only():
    # long greedy answers
    with PtyChat("--model", str(STORIES_HF), "--chat-template", TEMPLATE, "--temperature", "0",
                 "--max-tokens", "400") as chat:
        at = chat.read_until(b"> ", 0)                        # the prompt: the model is loaded
        for line in (b"Once upon a time\n", b"The cat\n"):
            chat.write(line)
            at = chat.read_until(line.strip() + b"\r\n", at)  # the terminal's echo
            chat.read_until(b" ", at + 10)                    # the answer has begun streaming
            chat.write(b"\x03")                               # Ctrl-C
            at = chat.read_until(b"[answer aborted]", at)
            at = chat.read_until(b"> ", at)                   # the session goes on
        assert chat.exit_code() == 0, bytes(chat.buf)
    assert b"tokens, finish=" not in chat.buf                 # neither answer ran to its end
