"""`kvserve chat`: an interactive chat in the terminal, streamed token by token.

    kvserve chat [--model PATH] [--system TEXT] [--max-tokens N] [--temperature T]

Each line read is a user turn; the whole conversation so far is rendered with the model's chat
template (kvserve/chat_template.py) and the answer is streamed to stdout as the engine produces
it, then kept in the history. `/exit` or end of input quits, `/reset` forgets the history.
Ctrl-C during an answer aborts that request (its blocks are freed) and keeps the session; the
interrupted turn is dropped from the history. A line per answer on stderr gives the prompt
length (the rendered history), the answer length and the speed.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

from kvserve.config import EngineConfig

HELP = "/exit quits, /reset forgets the conversation, Ctrl-C stops an answer"


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat with a model in the terminal",
                       description=__doc__.splitlines()[0])
    EngineConfig.add_cli_args(p)
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer, in tokens")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of the first answer (+1 per turn)")
    p.add_argument("--chat-template", default=None,
                   help="jinja2 chat template file or text (default: the model's)")
    p.set_defaults(func=cmd_chat)


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


def cmd_chat(args: argparse.Namespace) -> int:
    from kvserve import LLMEngine, SamplingParams
    from kvserve.chat_template import ChatRenderer

    interactive = sys.stdin.isatty()
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot chat: pass a --model with one.")
    renderer = ChatRenderer(engine.tokenizer, args.chat_template)
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())
        print(f"kvserve chat: {engine.config.model} ({HELP})", file=sys.stderr)
    opening = [{"role": "system", "content": args.system}] if args.system else []
    history = list(opening)
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        line = line.strip()
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history = list(opening)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            text = renderer.render(history, add_generation_prompt=True)
            prompt = {"prompt": text, "prompt_token_ids": renderer.encode(text)}
            seed = None if args.sampling_seed is None else args.sampling_seed + turn
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_p=args.top_p, seed=seed)
            start = time.monotonic()
            final, aborted = stream_answer(engine, f"chat-{turn}", prompt, params)
        except ValueError as e:          # e.g. the history no longer fits in max_model_len
            history.pop()
            print(f"\n[error: {e} Type /reset to start over.]", file=sys.stderr)
            continue
        turn += 1
        print()
        if aborted or final is None:
            history.pop()
            print("[answer aborted]", file=sys.stderr)
            continue
        c = final.outputs[0]
        history.append({"role": "assistant", "content": c.text})
        elapsed = time.monotonic() - start
        print(f"[{len(final.prompt_token_ids)} prompt tokens, {len(c.token_ids)} tokens, "
              f"finish={c.finish_reason}, {len(c.token_ids) / max(elapsed, 1e-9):.1f} tok/s]",
              file=sys.stderr)
    return 0
