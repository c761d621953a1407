"""A grammar-check worker process (structured/sandbox.py starts it): llguidance alone, no kvserve.

Run as a script (`python sandbox_worker.py`), so it imports nothing but llguidance, the
standard library and its sibling reasoning_grammar.py (standard library only): it starts in a
few tens of milliseconds and holds a few tens of MiB. It reads
one JSON message per line on stdin and answers one per line on stdout:

    {"tokenizer": <tokenizers JSON>, "n_vocab": V, "eos": id, "json_options": {...}}
        -> {"ready": true}                        (once, first)
    {"format": "json_schema" | "lark" | "gbnf" | "regex" | "choice", "text": ..., "kind": ...,
     "max_forced_tokens": N, "after_reasoning": "" | "deepseek_r1" | "qwen3"}
        -> {"ok": true} | {"error": "<what is wrong, naming structured_outputs.<kind>>"}

A check is the whole compile a sequence's matcher needs (the grammar's conversion, llguidance's
parser and lexer build, the first token mask through an LLExecutor as the engine computes it,
the forced tokens) on a thread with a fixed stack of STACK_BYTES, under an address-space limit
of MEMORY_BYTES. A grammar that overflows the stack, exhausts memory or hangs kills or stalls
this process only: its parent sees the end of the pipe or its deadline, and starts another.
"""
from __future__ import annotations

import ctypes
import json
import resource
import sys
import threading

import llguidance as llg
from reasoning_grammar import after_reasoning, marker_tokens      # (this script's folder: standard library only)

# The check's stack: a check that passes here passes in the engine, whose compile threads have
# ENGINE_STACK_BYTES (structured/compiler.py), eight times more, for the same input.
STACK_BYTES = 8 * 1024 * 1024


def check(ll_tok, opts: dict, fmt: str, text: str, kind: str, max_forced: int, reasoning: str = "") -> str | None:
    """None if the spec compiles to a grammar with some finite output; else what is wrong."""
    where = f"structured_outputs.{kind}"
    try:
        grammar = (llg.LLMatcher.grammar_from_json_schema(text, defaults=opts) if fmt == "json_schema"
                   else llg.grammar_from(fmt, text))
        if reasoning:
            grammar = after_reasoning(grammar, reasoning, marker_tokens(ll_tok))
    except ValueError as e:              # a GBNF grammar that does not convert, a bad JSON text
        return f"{where}: {e}"
    m = llg.LLMatcher(ll_tok, grammar, log_level=0)
    if m.is_error():
        return f"{where} does not compile: {first_line(m.get_error())}"
    words = (ll_tok.vocab_size + 31) // 32
    mask = bytearray(words * 4)                                 # [ceil(V / 32)] int32, bit per token
    address = ctypes.addressof((ctypes.c_char * len(mask)).from_buffer(mask))
    llg.LLExecutor().unsafe_compute_mask_ptr([(m, 0)], address, words * 4, 1)
    if m.is_error() or (not any(mask) and not m.is_accepting()):
        why = f" ({first_line(m.get_error())})" if m.is_error() else ""
        return f"{where} admits no output at all: its language is empty{why}."
    forced = m.compute_ff_tokens()
    if m.is_error():
        return f"{where} has no finite output: {first_line(m.get_error())}"
    if len(forced) >= max_forced:
        return (f"{where} forces at least {len(forced)} tokens before any choice, more than "
                f"max_model_len allows: it has no finite output (a rule that always recurses?).")
    return None


def first_line(message: str) -> str:
    """llguidance's message without the parser-state dump that may follow it."""
    return message.split("<state>", 1)[0].strip()[:1000]


def guarded(ll_tok, opts: dict, job: dict) -> str | None:
    try:
        return check(ll_tok, opts, job["format"], job["text"], job["kind"], job["max_forced_tokens"],
                     job.get("after_reasoning", ""))
    except Exception as e:  # noqa: BLE001 -- llguidance's own errors are the spec's
        return f"structured_outputs.{job['kind']} does not compile: {type(e).__name__}: {e}"


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    threading.stack_size(STACK_BYTES)
    out = sys.stdout
    init = json.loads(sys.stdin.readline())
    ll_tok = llg.LLTokenizer(init["tokenizer"], n_vocab=init["n_vocab"], eos_token=init["eos"])
    opts = init["json_options"]
    del init
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        result: list = []
        t = threading.Thread(target=lambda: result.append(guarded(ll_tok, opts, job)))
        t.start()
        t.join()
        error = result[0]
        out.write(json.dumps({"ok": True} if error is None else {"error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
