"""`kvserve perplexity`: the perplexity of a text file under llama.cpp's `llama-perplexity`
protocol, scored with the engine's prompt logprobs.

The file is tokenized whole (with BOS when the tokenizer adds one) and cut into `ctx`-token
chunks; the rest that does not fill a chunk is dropped. Each chunk's first token becomes BOS
(when the tokenizer uses one) and only its second half is scored: tokens ctx/2 + 1 .. ctx - 1,
each given everything before it in the chunk, so every scored token has at least ctx/2 tokens
of context. All chunks go to the engine at once, one request each (`prompt_logprobs=0`), so
it batches them under its token budget.

    PPL = exp(mean NLL)    +/- PPL * stderr(NLL)    (first order in the NLL's standard error)

`--kl-divergence-base FILE` also saves the run's distributions; a second run with
`--kl-divergence` compares its own to them (kvserve/quality/kl_divergence.py).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from kvserve.config import EngineConfig
from kvserve.sample.params import SamplingParams


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    nll: float                 # mean negative log-likelihood per scored token (nats)
    nll_err: float             # its standard error
    num_tokens: int            # scored tokens
    num_chunks: int
    running: list[float] = field(default_factory=list)   # PPL after chunks 1..i, in chunk order


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp takes them (BOS first when the tokenizer adds one), and
    the BOS id that starts every chunk (None: the tokenizer adds none, chunks keep their token)."""
    tokens = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    return tokens, bos if tokens and bos is not None and tokens[0] == bos else None


def make_chunks(tokens: list[int], ctx: int, num_chunks: int = -1, bos: int | None = None) -> list[list[int]]:
    """The first `num_chunks` (-1: all) whole chunks of `ctx` tokens, each starting with `bos`."""
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4 tokens, got {ctx}.")
    n = len(tokens) // ctx if num_chunks < 0 else min(num_chunks, len(tokens) // ctx)
    if n < 1:
        raise ValueError(f"the text has {len(tokens)} tokens: not one chunk of --ctx {ctx}; "
                         "give a longer text or a smaller --ctx.")
    chunks = [list(tokens[i * ctx:(i + 1) * ctx]) for i in range(n)]
    if bos is not None:
        for c in chunks:
            c[0] = bos
    return chunks


def first_scored(ctx: int) -> int:
    """The position whose logits score the first scored token: tokens first + 1 .. ctx - 1 are
    scored from the logits at positions first .. ctx - 2."""
    return ctx // 2


def score_chunks(engine, chunks: list[list[int]],
                 on_rows: Callable[[int, int, object], None] | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """Submit every chunk, step the engine until all are done, and yield (chunk index, NLL of
    its scored tokens [ctx - 1 - ctx/2]) in chunk order. `on_rows(chunk index, first position,
    raw logits [r, V])` sees every prompt row on the way (the engine's prompt_logprobs_hook)."""
    first = first_scored(len(chunks[0]))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    index = {}
    for i, c in enumerate(chunks):
        index[f"ppl-{i}"] = i
        engine.add_request(f"ppl-{i}", {"prompt_token_ids": c}, params)
    sampling = engine.core.runner.sampling
    saved = sampling.prompt_logprobs_hook
    if on_rows is not None:
        # n = 1: each chunk's one sequence has the request's id
        sampling.prompt_logprobs_hook = lambda seq, pos, logits: on_rows(index[seq.request_id], pos, logits)
    done, nxt = {}, 0
    try:
        while nxt < len(chunks):
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"chunk {nxt} never finished")
            for out in engine.step():
                if not out.finished:
                    continue
                failed = next((c for c in out.outputs if c.finish_reason in ("error", "abort")), None)
                if failed is not None:
                    raise RuntimeError(f"{out.request_id} failed in the engine: {failed.error}")
                c, entries = chunks[index[out.request_id]], out.prompt_logprobs
                done[index[out.request_id]] = -np.array(
                    [entries[j][c[j]].logprob for j in range(first + 1, len(c))], dtype=np.float64)
            while nxt in done:
                yield nxt, done.pop(nxt)
                nxt += 1
    finally:
        sampling.prompt_logprobs_hook = saved
        engine.abort_request([rid for rid, i in index.items() if i >= nxt])


def nll_stats(nll_sum: float, nll2_sum: float, count: int) -> tuple[float, float]:
    """(mean, standard error of the mean) from the sums of x and x^2 over `count` values."""
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    return mean, math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0


def perplexity(engine, chunks: list[list[int]], on_rows=None,
               on_chunk: Callable[[int, float], None] | None = None) -> PerplexityResult:
    """Score `chunks` (make_chunks) with `engine`; `on_chunk(i, running PPL)` after each chunk."""
    s = s2 = 0.0
    count, running = 0, []
    for i, nll in score_chunks(engine, chunks, on_rows):
        s += float(nll.sum())
        s2 += float((nll * nll).sum())
        count += len(nll)
        running.append(math.exp(s / count))
        if on_chunk is not None:
            on_chunk(i, running[-1])
    mean, err = nll_stats(s, s2, count)
    ppl = math.exp(mean)
    return PerplexityResult(ppl, ppl * err, mean, err, count, len(chunks), running)


# -- command line ---------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of a text file (llama-perplexity's protocol)")
    EngineConfig.add_cli_args(p)
    p.add_argument("--file", default=None,
                   help="UTF-8 text to score (with --kl-divergence the base file holds the tokens)")
    p.add_argument("--ctx", type=int, default=512,
                   help="tokens per chunk; the first half of each is context, the second is scored")
    p.add_argument("--chunks", type=int, default=-1, help="score at most this many chunks (-1: all)")
    p.add_argument("--batch", type=int, default=None,
                   help="tokens per engine step (llama-perplexity's -b; sets --max-num-batched-tokens)")
    p.add_argument("--kl-divergence-base", metavar="FILE", default=None,
                   help="save this run's distributions of the scored tokens to FILE; "
                        "with --kl-divergence, compare this run against FILE")
    p.add_argument("--kl-divergence", action="store_true",
                   help="compare against --kl-divergence-base: mean KL divergence, same top token")
    p.add_argument("--kl-top-k", type=int, default=0,
                   help="save only the top K log-probabilities and the rest's mass (0: whole vocabulary)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kvserve import LLMEngine
    from kvserve.quality import kl_divergence as kl

    if args.kl_divergence and not args.kl_divergence_base:
        raise ValueError("--kl-divergence needs --kl-divergence-base FILE (from an earlier run).")
    if args.batch is not None:
        args.max_num_batched_tokens = args.batch
    if args.file is None and not args.kl_divergence:
        raise ValueError("--file is required (the text to score).")
    base = kl.load_base(args.kl_divergence_base) if args.kl_divergence else None
    if base is not None:
        args.ctx = base.ctx
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    limit = engine.core.limits.max_model_len        # the served context (the KV pool's, if smaller)
    if args.ctx >= limit:
        raise ValueError(f"--ctx {args.ctx} does not fit: the engine takes prompts shorter than "
                         f"max_model_len ({limit}); use --ctx {limit - 1} or less.")
    if base is not None:
        chunks = base.chunks(args.chunks)
    else:
        if engine.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot read --file.")
        with open(args.file, encoding="utf-8") as f:
            tokens, bos = tokenize(engine.tokenizer, f.read())
        chunks = make_chunks(tokens, args.ctx, args.chunks, bos)
    first = first_scored(args.ctx)
    print(f"perplexity: {len(chunks)} chunks of {args.ctx} tokens, scoring the last "
          f"{args.ctx - 1 - first} of each; {engine.config.scheduler.max_num_batched_tokens} tokens per step")
    if base is not None:
        rows = kl.Comparison(base, len(chunks), first)
    elif args.kl_divergence_base:
        rows = kl.Recorder(chunks, first, args.kl_top_k)
    else:
        rows = None

    def show(i: int, ppl: float) -> None:
        sys.stdout.write(f"[{i + 1}]{ppl:.4f},")
        sys.stdout.flush()

    result = perplexity(engine, chunks, rows, show)
    print()
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_err:.5f} "
          f"({result.num_tokens} tokens, mean NLL {result.nll:.6f} +/- {result.nll_err:.6f})")
    if isinstance(rows, kl.Recorder):
        rows.save(args.kl_divergence_base)
        print(f"saved the distributions of {result.num_tokens} tokens to {args.kl_divergence_base}")
    elif rows is not None:
        print(rows.summary().report())
    return 0
