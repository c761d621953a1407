"""`kvserve chat`'s slash commands (one Conversation, shared by both modes) on a fake input
stream and a fake backend; the local mode's commands in a subprocess; and `kvserve chat --url`
against a live server with --api-key: greedy answers equal the API's turn by turn, /save writes
the conversation, a bad key or model is a clear error, Ctrl-C aborts the request on the server."""
from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys

import httpx
import pytest

from kvserve.entrypoints.chat import COMMANDS, Answer, Conversation, api_base, run_session, sse_data
from tests.conftest import STORIES_HF
from tests.engine.pty_chat import PtyChat
from tests.engine.test_chat import ROOT, TEMPLATE, prompt_counts
from tests.server.live import LiveServer

KEY = "chat-cli-key"


class FakeBackend:
    """Answers 'answer-N' (or refuses / is interrupted on the turns named) and keeps what it got."""

    def __init__(self, refuse: int | None = None, abort: int | None = None):
        self.calls: list[list[dict]] = []
        self.refuse, self.abort = refuse, abort

    def answer(self, messages, turn):
        self.calls.append(copy.deepcopy(messages))
        if len(self.calls) == self.refuse:
            raise ValueError("the history no longer fits.")
        text = f"answer-{len(self.calls)}"
        sys.stdout.write(text)
        return Answer(text, 3, 2, "length", aborted=len(self.calls) == self.abort)


def session(monkeypatch, capsys, lines: str, system: str | None = None, **fake):
    """Run a session over `lines` as stdin: (backend, conversation, stdout, stderr, unread stdin)."""
    stdin = io.StringIO(lines)
    monkeypatch.setattr(sys, "stdin", stdin)
    backend, conv = FakeBackend(**fake), Conversation(system, model="fake-model")
    assert run_session(conv, backend, interactive=False) == 0
    out, err = capsys.readouterr()
    return backend, conv, out, err, stdin.read()


def test_help_lists_every_command_and_is_never_sent(monkeypatch, capsys):
    backend, conv, out, err, _ = session(monkeypatch, capsys, "/help\n/nope\n")
    assert backend.calls == [] and conv.turns == [] and out == ""
    for command, what in COMMANDS.items():
        assert command in err and what in err
    assert "[unknown command /nope: /help lists the commands]" in err


def test_system_sets_and_removes_the_opening_message(monkeypatch, capsys):
    backend, conv, out, err, _ = session(monkeypatch, capsys,
                                         "hi\n/system Be brief.\nagain\n/system\nlast\n", system="Old.")
    first, second, third = backend.calls
    assert first == [{"role": "system", "content": "Old."}, {"role": "user", "content": "hi"}]
    assert second[0] == {"role": "system", "content": "Be brief."} and second[1:] == \
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "answer-1"},
         {"role": "user", "content": "again"}]
    assert third[0]["role"] == "user" and len(third) == 5          # removed, the turns kept
    assert "[system prompt set]" in err and "[system prompt removed]" in err
    assert out == "answer-1\nanswer-2\nanswer-3\n"                 # confirmations never on stdout


def test_reset_clears_the_turns_and_keeps_the_system_prompt(monkeypatch, capsys):
    backend, conv, _, err, _ = session(monkeypatch, capsys, "one\ntwo\n/reset\nthree\n", system="S.")
    assert len(backend.calls[1]) == 4
    assert backend.calls[2] == [{"role": "system", "content": "S."}, {"role": "user", "content": "three"}]
    assert "[conversation reset]" in err


def test_save_writes_the_conversation_as_json(monkeypatch, capsys, tmp_path):
    path = tmp_path / "chat.json"
    bad = tmp_path / "no-such-folder" / "x.json"
    _, conv, _, err, _ = session(monkeypatch, capsys, f"hello\n/save {path}\n/save\n/save {bad}\nmore\n",
                                 system="S.")
    saved = json.loads(path.read_text())
    assert saved == {"model": "fake-model", "messages": [
        {"role": "system", "content": "S."}, {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "answer-1"}]}
    assert f"[saved 3 messages to {path}]" in err and "[usage: /save FILE]" in err
    assert f"[error: cannot write {bad}:" in err and len(conv.turns) == 4   # the session went on


@pytest.mark.parametrize("command", ["/quit", "/exit"])
def test_quit_and_exit_stop_reading(monkeypatch, capsys, command):
    backend, _, out, _, unread = session(monkeypatch, capsys, f"one\n{command}\nnever sent\n")
    assert len(backend.calls) == 1 and out == "answer-1\n" and unread == "never sent\n"


def test_refused_and_aborted_turns_leave_the_history(monkeypatch, capsys):
    backend, conv, _, err, _ = session(monkeypatch, capsys, "a\nb\nc\n", refuse=1, abort=2)
    assert "[error: the history no longer fits.]" in err and "[answer aborted]" in err
    assert backend.calls[2] == [{"role": "user", "content": "c"}]   # neither a nor b is kept
    assert conv.turns == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "answer-3"}]
    assert "[3 prompt tokens, 2 tokens, finish=length" in err


def test_sse_and_url_parsing():
    lines = ['data: {"a": 1}', "", ": comment", "data: {\"b\":", "data: 2}", "", "data: [DONE]", "",
             'data: {"after": 1}', ""]
    assert list(sse_data(lines)) == ['{"a": 1}', '{"b":\n2}']

    def live():          # an event as soon as its blank line is read, not at the end of the stream
        yield from ['data: {"a": 1}', ""]
        raise AssertionError("read past the first event")
    assert next(sse_data(live())) == '{"a": 1}'
    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"


def run_chat(*args: str, stdin: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    full.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_PROXY="*", **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", *args], input=stdin, cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=300)


def test_local_mode_runs_the_same_commands(tmp_path):
    path = tmp_path / "local.json"
    p = run_chat("--model", str(STORIES_HF), "--chat-template", TEMPLATE, "--temperature", "0",
                 "--max-tokens", "6", "--num-kv-blocks", "64",
                 stdin=f"/help\n/system Tell a story.\nOnce upon a time\n/save {path}\n/quit\nnever\n")
    assert p.returncode == 0, p.stderr
    saved = json.loads(path.read_text())
    assert saved["model"] == str(STORIES_HF) and [m["role"] for m in saved["messages"]] == \
        ["system", "user", "assistant"]
    assert saved["messages"][0]["content"] == "Tell a story."
    assert p.stdout == saved["messages"][2]["content"] + "\n" and "/save FILE" in p.stderr


# ------------------------------------------------------------------ --url against a live server


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("--api-key", KEY)
    yield srv
    srv.stop()


def api_chat(server, messages: list[dict], max_tokens: int) -> dict:
    r = httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "stories260K-hf", "messages": messages, "temperature": 0,
                         "max_tokens": max_tokens}, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_url_mode_equals_the_api_turn_by_turn(server, tmp_path):
    path = tmp_path / "remote.json"
    p = run_chat("--url", server.base_url, "--api-key", KEY, "--temperature", "0", "--max-tokens", "24",
                 "--system", "You tell stories.",
                 stdin=f"Once upon a time\n/help\nThe cat\n/save {path}\n/reset\nOnce upon a time\n/exit\n")
    assert p.returncode == 0, p.stderr
    history = [{"role": "system", "content": "You tell stories."}]
    answers, counts = [], []
    for line in ("Once upon a time", "The cat"):
        history.append({"role": "user", "content": line})
        body = api_chat(server, history, 24)
        answers.append(body["choices"][0]["message"]["content"])
        counts.append(body["usage"]["prompt_tokens"])
        history.append({"role": "assistant", "content": answers[-1]})
    assert all(answers)
    assert p.stdout == f"{answers[0]}\n{answers[1]}\n{answers[0]}\n"      # after /reset: turn one again
    assert prompt_counts(p.stderr) == [counts[0], counts[1], counts[0]]
    assert json.loads(path.read_text()) == {"model": "stories260K-hf", "messages": history}
    assert "[conversation reset]" in p.stderr and "/system TEXT" in p.stderr


def test_url_mode_errors_are_clear(server, tmp_path):
    p = run_chat("--url", server.base_url + "/v1", "--api-key", "wrong", stdin="hi\n")
    assert p.returncode == 2 and "401" in p.stderr and "--api-key" in p.stderr, p.stderr
    p = run_chat("--url", server.base_url, stdin="/exit\n", env={"OPENAI_API_KEY": KEY})
    assert p.returncode == 0, p.stderr                             # the key from the environment
    path = tmp_path / "none.json"
    p = run_chat("--url", server.base_url, "--api-key", KEY, "--model", "nope",
                 stdin=f"Once upon a time\n/save {path}\n")
    assert p.returncode == 0 and "[error: the server answered 404:" in p.stderr and "'nope'" in p.stderr
    assert json.loads(path.read_text())["messages"] == []          # the refused turn was undone
    p = run_chat("--url", server.base_url, "--num-kv-blocks", "8", stdin="")
    assert p.returncode == 2 and "--num-kv-blocks" in p.stderr


def test_url_mode_ctrl_c_aborts_the_request_on_the_server(server):
    def aborted(m):
        return sum(v for k, v in m.items() if 'finished_reason="abort"' in k and "success_total{" in k)
    before = aborted(server.metrics())
    # one long greedy answer; read every 2 ms, so the Ctrl-C comes within its first tokens
    with PtyChat("--url", server.base_url, "--api-key", KEY, "--temperature", "0", "--max-tokens", "480",
                 env={"NO_PROXY": "*"}, poll_s=0.002) as chat:
        at = chat.read_until(b"> ", 0, 60)                         # the models are listed
        chat.write(b"Once upon a time\n")
        at = chat.read_until(b"Once upon a time\r\n", at, 60)     # the terminal's echo
        chat.read_until(b" ", at, 60)                              # the answer has begun
        chat.write(b"\x03")                                        # Ctrl-C
        at = chat.read_until(b"[answer aborted]", at, 60)
        chat.read_until(b"> ", at, 60)                             # the session goes on
        assert chat.exit_code() == 0, bytes(chat.buf)
    server.wait_for("the interrupted request counted as aborted", lambda m: aborted(m) == before + 1)
    server.wait_idle()
