"""`kvserve chat`: an interactive chat in the terminal, streamed token by token.

    kvserve chat [--model PATH] [--system TEXT] [--max-tokens N] [--temperature T]
    kvserve chat --url http://HOST:8000/v1 [--api-key KEY] [--model NAME] [--system TEXT] ...

Each line read is a user turn. Locally the whole conversation so far is rendered with the
model's chat template (kvserve/frontend/chat_template.py) and the answer is streamed to stdout as the
engine produces it; with --url the conversation goes to any OpenAI-compatible server's
/v1/chat/completions (stream: true, server-sent events) and the server renders it. Either way
the answer is kept in the history. Lines that start with "/" are commands, never sent to the
model: /help lists them (/system, /reset, /save FILE, /quit or /exit); end of input quits too.
Ctrl-C during an answer aborts that request (locally its blocks are freed; a server aborts it
when the connection closes) and keeps the session; the interrupted turn is dropped from the
history. A line per answer on stderr gives the prompt length, the answer length and the speed.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import EngineConfig

COMMANDS = {
    "/help": "list these commands",
    "/system TEXT": "set the system prompt that opens the conversation (no TEXT: remove it)",
    "/reset": "forget the conversation (the system prompt stays)",
    "/save FILE": "write the conversation to FILE as JSON",
    "/quit, /exit": "leave (so does end of input)",
}
HELP = "/help lists the commands, Ctrl-C stops an answer"


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a model in the terminal, or with a server (--url)",
                       description=__doc__.splitlines()[0])
    EngineConfig.add_cli_args(p)
    p.add_argument("--url", default=None,
                   help="chat with this OpenAI-compatible server instead of a local model, e.g. "
                        "http://localhost:8000/v1 (/v1 is added when missing); --model then names "
                        "the served model (default: the first of its /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="with --url: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the first answer (+1 per turn)")
    p.add_argument("--chat-template", default=None,
                   help="jinja2 chat template file or text (default: the model's; local mode only)")
    p.set_defaults(func=cmd_chat)


@dataclass
class Answer:
    """One answer as the loop needs it; the counts are None when a server sent no usage."""
    text: str
    prompt_tokens: int | None = None
    tokens: int | None = None
    finish: str | None = None
    aborted: bool = False


class Conversation:
    """The system prompt and the turns, and the slash commands that change them (both modes)."""

    def __init__(self, system: str | None = None, model: str = ""):
        self.system = system
        self.model = model
        self.turns: list[dict] = []

    def messages(self) -> list[dict]:
        opening = [{"role": "system", "content": self.system}] if self.system else []
        return opening + self.turns

    def command(self, line: str, err) -> bool:
        """Run one slash command, its confirmation on `err`; False when it ends the session."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        if name == "/help":
            width = max(map(len, COMMANDS))
            print("\n".join(f"  {c:<{width}}  {what}" for c, what in COMMANDS.items()), file=err)
        elif name == "/system":
            self.system = arg or None
            print("[system prompt set]" if arg else "[system prompt removed]", file=err)
        elif name == "/reset":
            self.turns = []
            print("[conversation reset]", file=err)
        elif name == "/save":
            self.save(arg, err)
        else:
            print(f"[unknown command {name}: /help lists the commands]", file=err)
        return True

    def save(self, path: str, err) -> None:
        if not path:
            print("[usage: /save FILE]", file=err)
            return
        messages = self.messages()
        try:
            Path(path).expanduser().write_text(json.dumps({"model": self.model, "messages": messages},
                                                          indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            print(f"[error: cannot write {path}: {e.strerror or e}]", file=err)
            return
        print(f"[saved {len(messages)} messages to {path}]", file=err)


def run_session(conversation: Conversation, backend, interactive: bool, read=input, err=None) -> int:
    """Read lines until /quit or end of input: commands run, other lines are user turns that
    `backend.answer(messages, turn)` streams to stdout (ValueError: refused, the turn undone)."""
    err = err or sys.stderr
    turn = 0
    while True:
        try:
            line = read("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not conversation.command(line, err):
                break
            continue
        conversation.turns.append({"role": "user", "content": line})
        start = time.monotonic()
        try:
            answer = backend.answer(conversation.messages(), turn)
        except ValueError as e:         # e.g. the history no longer fits, or the server said no
            conversation.turns.pop()
            print(f"\n[error: {e}]", file=err)
            continue
        turn += 1
        print()
        if answer.aborted:
            conversation.turns.pop()
            print("[answer aborted]", file=err)
            continue
        conversation.turns.append({"role": "assistant", "content": answer.text})
        print(stats_line(answer, time.monotonic() - start), file=err)
    return 0


def stats_line(a: Answer, elapsed: float) -> str:
    if a.tokens is None:
        return f"[finish={a.finish}, {elapsed:.2f} s]"
    return (f"[{a.prompt_tokens} prompt tokens, {a.tokens} tokens, finish={a.finish}, "
            f"{a.tokens / max(elapsed, 1e-9):.1f} tok/s]")


# ------------------------------------------------------------------ local mode: an engine here


class _Interrupt:
    """SIGINT sets a flag while an answer streams, so the engine is stopped between steps."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def _on_signal(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def stream_answer(engine, rid: str, prompt: dict, params, out=None) -> tuple[object, bool]:
    """Run one request, writing its text to `out` (stdout) as it grows; (last output, aborted)."""
    out = out or sys.stdout
    shown, last = "", None
    with _Interrupt() as interrupt:
        engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            if interrupt.hit:
                engine.abort_request(rid)
                return last, True
            for o in engine.step():
                if o.request_id != rid:
                    continue
                text = o.outputs[0].text
                out.write(text[len(shown):])
                out.flush()
                shown, last = text, o
    return last, False


class LocalChat:
    """Answers from an engine in this process, the history rendered with the chat template."""

    def __init__(self, args: argparse.Namespace):
        from kvserve import LLMEngine
        from kvserve.frontend.chat_template import ChatRenderer

        self.args = args
        self.engine = LLMEngine(EngineConfig.from_cli_args(args))
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat: pass a --model with one.")
        self.renderer = ChatRenderer(self.engine.tokenizer, args.chat_template)
        self.name = self.engine.config.model.model

    def answer(self, messages: list[dict], turn: int) -> Answer:
        from kvserve import SamplingParams

        a = self.args
        try:
            text = self.renderer.render(messages, add_generation_prompt=True)
            prompt = {"prompt": text, "prompt_token_ids": self.renderer.encode(text)}
            seed = None if a.sampling_seed is None else a.sampling_seed + turn
            params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                    seed=seed)
            final, aborted = stream_answer(self.engine, f"chat-{turn}", prompt, params)
        except ValueError as e:
            raise ValueError(f"{e} Type /reset to start over.") from e
        if aborted or final is None:
            return Answer("", aborted=True)
        c = final.outputs[0]
        return Answer(c.text, len(final.prompt_token_ids), len(c.token_ids), c.finish_reason)


# ------------------------------------------------------------------ --url: an OpenAI-compatible server


def api_base(url: str) -> str:
    """'http://h:8000' or 'http://h:8000/v1/' -> 'http://h:8000/v1'."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def sse_data(lines):
    """The data of each server-sent event in `lines`, up to 'data: [DONE]'."""
    data: list[str] = []
    for line in itertools.chain(lines, [""]):
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload, data = "\n".join(data), []
            if payload == "[DONE]":
                return
            yield payload


def refusal(r) -> str:
    """What a non-200 response says: the server's error message, and what to do about a 401."""
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:300]
    if r.status_code == 401:
        return f"the server refused the API key (401: {message}); pass --api-key KEY or set $OPENAI_API_KEY"
    return f"the server answered {r.status_code}: {message}"


class RemoteChat:
    """Answers from an OpenAI-compatible server: POST /v1/chat/completions, streamed."""

    def __init__(self, args: argparse.Namespace):
        import httpx

        self.args = args
        self.base = api_base(args.url)
        key = args.api_key or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=self.base, headers=headers,
                                   timeout=httpx.Timeout(30.0, read=600.0))
        self.http_error = httpx.HTTPError
        self.model = args.model or self.first_model()
        self.name = f"{self.model} at {self.base}"

    def first_model(self) -> str:
        try:
            r = self.client.get("/models")
        except self.http_error as e:
            raise ValueError(f"cannot reach {self.base}: {e}") from e
        if r.status_code != 200:
            raise ValueError(refusal(r))
        models = r.json().get("data") or []
        if not models:
            raise ValueError(f"{self.base}/models lists no model: pass --model NAME")
        return models[0]["id"]

    def answer(self, messages: list[dict], turn: int, out=None) -> Answer:
        out = out or sys.stdout
        a = self.args
        body = {"model": self.model, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": a.max_tokens,
                "temperature": a.temperature, "top_p": a.top_p}
        if a.sampling_seed is not None:
            body["seed"] = a.sampling_seed + turn
        text, usage, finish = [], None, None
        try:
            with self.client.stream("POST", "/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise ValueError(refusal(r))
                for data in sse_data(r.iter_lines()):
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        raise ValueError(f"the server ended the answer: {chunk['error'].get('message')}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        delta = (choice.get("delta") or {}).get("content")
                        if delta:
                            out.write(delta)
                            out.flush()
                            text.append(delta)
                        finish = choice.get("finish_reason") or finish
        except KeyboardInterrupt:       # the connection is closed: the server aborts the request
            return Answer("".join(text), aborted=True)
        except self.http_error as e:
            raise ValueError(f"the request to {self.base} failed: {e}") from e
        if usage is None:
            return Answer("".join(text), finish=finish)
        return Answer("".join(text), usage.get("prompt_tokens"), usage.get("completion_tokens"), finish)


def _local_only_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags (and --chat-template) given with --url, where the server has its own."""
    from kvserve.config.cli_args import cli_default, flag_fields, option_name

    given = [option_name(f) for f in flag_fields(EngineConfig)
             if f.name != "model" and getattr(args, f.name) != cli_default(f)]
    return given + (["--chat-template"] if args.chat_template is not None else [])


def cmd_chat(args: argparse.Namespace) -> int:
    if args.url is not None:
        local = _local_only_flags(args)
        if local:
            raise ValueError(f"{', '.join(local)} configure a local model; with --url the server "
                             "runs its own: leave them out")
        backend = RemoteChat(args)
    else:
        if args.api_key is not None:
            raise ValueError("--api-key is for a server: use it with --url")
        backend = LocalChat(args)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        # Ctrl-C stops an answer even where the shell started us with SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"kvserve chat: {backend.name} ({HELP})", file=sys.stderr)
    model = getattr(backend, "model", backend.name)
    return run_session(Conversation(args.system, model), backend, interactive)
