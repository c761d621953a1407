"""Grammars compiled by llguidance against the model's own tokenizer, off the engine loop.

`ll_tokenizer(tokenizer, vocab_size)`: llguidance's view of a kvserve tokenizer, read from the
`tokenizers` JSON that every tokenizers-backed kvserve tokenizer holds (byte-level BPE or
SentencePiece, from tokenizer.json or GGUF metadata); built once per tokenizer (about 0.3 s for
a 49k vocabulary) and kept while the tokenizer lives. Its size is the model's vocabulary (the
logits' width), so a mask covers every logit; ids past the tokenizer's are never allowed.
Specs reach it only after the check in a worker process (sandbox.py), so what would crash or
hang the compiler is refused there. `compile_matcher`: an LLMatcher at the grammar's start.
`GrammarCompiler`: one per engine; compiles specs that passed the check in worker threads whose
stacks are ENGINE_STACK_BYTES (llguidance releases the GIL while it builds), and keeps the
compiled matchers by spec key (LRU); every sequence takes its own deep copy (about 10 us).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance as llg

from kvserve.structured.reasoning_grammar import after_reasoning, marker_tokens

# Compile-time histogram bounds, in seconds (kvserve:grammar_compile_time_seconds).
COMPILE_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 5.0, 10.0, 30.0, 60.0)
MAX_CACHED_GRAMMARS = 256
# Compile threads: a slow grammar holds back at most one of them (llguidance's own fuel limits
# bound every compile).
NUM_COMPILE_THREADS = max(2, min(4, os.cpu_count() or 1))
# Their stacks: eight times the sandbox's check (sandbox_worker.STACK_BYTES), so a spec that
# passed the check compiles here whatever its recursion depth (virtual memory: pages are touched
# only as deep as a compile goes).
ENGINE_STACK_BYTES = 64 * 1024 * 1024

_ll_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ll_lock = threading.Lock()


def llg_vocab(tokenizer, vocab_size: int | None = None, eos_token_id: int | None = None):
    """(the tokenizers.Tokenizer behind a kvserve tokenizer, the grammar's vocabulary size, its
    EOS: the engine's, which a complete grammar allows; default the tokenizer's). ValueError
    when the model has no tokenizer kvserve can hand to llguidance."""
    backend = getattr(tokenizer, "_tok", None)      # TokenizersBacked: a tokenizers.Tokenizer
    if backend is None:
        what = "no tokenizer" if tokenizer is None else f"a {type(tokenizer).__name__}"
        raise ValueError(f"structured outputs need the model's tokenizer as tokenizer.json or GGUF "
                         f"metadata; this model has {what}.")
    size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
    return backend, size, eos_token_id if eos_token_id is not None else tokenizer.eos_token_id


def ll_tokenizer(tokenizer, vocab_size: int | None = None, eos_token_id: int | None = None) -> llg.LLTokenizer:
    """The llguidance tokenizer of a kvserve tokenizer (cached per tokenizer object, size and
    EOS; see llg_vocab)."""
    backend, size, eos = llg_vocab(tokenizer, vocab_size, eos_token_id)
    with _ll_lock:
        built = _ll_tokenizers.setdefault(tokenizer, {})
        if (size, eos) not in built:
            built[size, eos] = llg.LLTokenizer(backend.to_str(), n_vocab=size, eos_token=eos)
        return built[size, eos]


# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace (a small model
# left free to indent can loop on whitespace). A schema's "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(params, ll_tok=None) -> str:
    """llguidance's grammar for StructuredOutputsParams `params` (no validity check yet)."""
    fmt, text, reasoning = params.key
    try:
        if fmt == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        else:
            grammar = llg.grammar_from(fmt, text)
        return after_reasoning(grammar, reasoning, marker_tokens(ll_tok)) if reasoning else grammar
    except ValueError as e:            # a GBNF grammar that does not convert, a bad JSON text
        raise ValueError(f"structured_outputs.{params.kind}: {e}") from None


def compile_matcher(params, ll_tok: llg.LLTokenizer) -> llg.LLMatcher:
    """A matcher at the start of `params`' grammar; ValueError with llguidance's message."""
    m = llg.LLMatcher(ll_tok, grammar_text(params, ll_tok), log_level=0)
    if m.is_error():
        raise ValueError(f"structured_outputs.{params.kind} does not compile: {matcher_error(m)}")
    return m


def matcher_error(m: llg.LLMatcher) -> str:
    """A matcher's error without the parser-state dump llguidance appends to it."""
    return m.get_error().split("<state>", 1)[0].strip()


class GrammarCompiler:
    """Compiles StructuredOutputsParams against one tokenizer in a worker thread, caches the
    results by `params.key`. `submit` is called from the engine loop; only the worker builds."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None = None,
                 max_cached: int = MAX_CACHED_GRAMMARS):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_cached = max_cached
        self._pool: ThreadPoolExecutor | None = None       # started by the first compile
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], tuple[llg.LLMatcher, int]] = OrderedDict()
        self._inflight: dict[tuple[str, str], Future] = {}
        self.num_compiles = 0            # compiles that finished, with or without an error
        self.num_errors = 0
        self.num_cache_hits = 0          # requests served from the cache or an in-flight compile
        self.compile_time_sum = 0.0
        self.compile_time_counts = [0] * (len(COMPILE_TIME_BUCKETS) + 1)   # the last: +Inf

    def submit(self, params) -> Future:
        """A future of (the compiled matcher, to deep-copy and never advance; its vocabulary size)."""
        key = params.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                done: Future = Future()
                done.set_result(self._cache[key])
                return done
            if key in self._inflight:
                self.num_cache_hits += 1
                return self._inflight[key]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="kvserve-grammar")
            fut = self._inflight[key] = Future()
            fut.started_at = None            # time.monotonic() once a thread takes it (its deadline's start)
            _with_stack(ENGINE_STACK_BYTES, lambda: self._pool.submit(self._compile, params, fut))
            return fut

    def _compile(self, params, fut: Future) -> None:
        fut.started_at = time.monotonic()
        try:
            fut.set_result(self._compiled(params))
        except BaseException as e:  # noqa: BLE001 -- the request's error, through its future
            fut.set_exception(e)

    def _compiled(self, params) -> tuple[llg.LLMatcher, int]:
        t0 = time.perf_counter()
        try:
            ll_tok = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_id)
            compiled = compile_matcher(params, ll_tok), ll_tok.vocab_size
        except BaseException:
            self._record(params.key, None, time.perf_counter() - t0)
            raise
        self._record(params.key, compiled, time.perf_counter() - t0)
        return compiled

    def _record(self, key, compiled, seconds: float) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            self.num_compiles += 1
            self.compile_time_sum += seconds
            self.compile_time_counts[next((i for i, b in enumerate(COMPILE_TIME_BUCKETS) if seconds <= b),
                                          len(COMPILE_TIME_BUCKETS))] += 1
            if compiled is None:
                self.num_errors += 1
                return
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)

    def stats(self) -> dict:
        """Counters and the compile-time histogram (cumulative counts per bucket bound)."""
        with self._lock:
            counts = list(self.compile_time_counts)
            cumulative = [sum(counts[:i + 1]) for i in range(len(counts))]
            return dict(compiles=self.num_compiles, compile_errors=self.num_errors,
                        cache_hits=self.num_cache_hits, compile_time_sum=self.compile_time_sum,
                        compile_time_buckets=list(zip([*COMPILE_TIME_BUCKETS, float("inf")], cumulative)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


_stack_lock = threading.Lock()


def _with_stack(nbytes: int, fn):
    """fn(), with threads it starts given `nbytes` of stack (ThreadPoolExecutor starts its
    threads inside submit)."""
    with _stack_lock:
        old = threading.stack_size(nbytes)
        try:
            return fn()
        finally:
            threading.stack_size(old)
