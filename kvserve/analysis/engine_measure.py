"""The planner meets the engine: kvserve's own measured steps and serving runs, in the planner's terms.

roofline_points   prefill and decode steps of the real engine as roofline points (seed 000): FLOPs and
                  bytes counted from the model's shape (roofline.prefill_step / decode_step), time
                  from the engine's step timer (`LLMEngine.stats().step_time_total`).
run_serving       drive the engine with requests arriving over wall-clock time (the `simulate_serving`
                  workload made real) and summarize TTFT / ITL / throughput as the simulator does, so
                  a calibrated simulation and a measured run print the same columns.
Imports kvserve's engine lazily (the analysis package works without it).
"""
from __future__ import annotations

import math
import random
import time

from .roofline import Op, decode_step, prefill_step
from .simulate import Request, summarize
from .specs import ModelSpec, count_params

ENGINE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def model_spec_of(engine, name: str = "kvserve model") -> ModelSpec:
    """ModelSpec of the model an engine serves (its ModelConfig), parameters counted from the shape.
    N_act (the parameters a token multiplies) leaves out an untied input embedding table, which is a
    lookup, not a matmul (a tied table is the LM head's matmul and stays); bytes still count it all."""
    c = engine.model_config
    n = count_params(c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                     c.vocab_size, c.tie_word_embeddings, qk_norm=getattr(c, "qk_norm", False))
    n_act = n if c.tie_word_embeddings else n - c.vocab_size * c.hidden_size
    mla = getattr(c, "kv_lora_rank", 0) or None             # multi-head latent attention's cache
    return ModelSpec(name, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.intermediate_size, c.vocab_size, float(n), float(n_act), c.tie_word_embeddings,
                     kv_lora_rank=mla, qk_rope_head_dim=mla and c.qk_rope_head_dim,
                     v_head_dim=mla and c.v_head_dim)


def engine_dtype(engine) -> str:
    """The engine's weight dtype as the analysis names it ('fp32', 'bf16', 'fp16')."""
    return ENGINE_DTYPES.get(str(engine.config.model.dtype), "fp32")


def _timed_step(engine) -> tuple[float, list]:
    """One engine step; its seconds by the engine's own step timer."""
    before = engine.stats().step_time_total
    outs = engine.step()
    return engine.stats().step_time_total - before, outs


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def roofline_points(llm, prefill_tokens=(128, 512), decode_batches=(1, 8, 32), context: int = 128,
                    repeats: int = 2, seed: int = 0, name: str = "kvserve model") -> tuple[list[Op], ModelSpec, str]:
    """Measure the engine's steps as roofline points. For each prefill length T: one request of T fresh
    random tokens, the step that computes the prompt (best of `repeats`); for each decode batch B: B
    requests of `context` tokens, the fastest step once all B decode. The engine's token budget must
    hold the longest prefill in one step. Returns (timed ops, the model's spec, the weight dtype)."""
    from kvserve import SamplingParams

    eng = llm.engine
    spec, dtype = model_spec_of(eng, name), engine_dtype(eng)
    kv_dtype = dtype if eng.config.cache.kv_cache_dtype == "auto" else eng.config.cache.kv_cache_dtype
    vocab = int(eng.model_config.vocab_size)
    rng = random.Random(seed)
    rid = [0]

    def add(n_prompt, max_tokens):
        rid[0] += 1
        eng.add_request(f"roof-{rid[0]}", {"prompt_token_ids": _prompt(rng, n_prompt, vocab)},
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    add(min(prefill_tokens), 2)                       # warm-up
    while eng.has_unfinished_requests():
        eng.step()
    ops = []
    for T in prefill_tokens:
        if T > eng.config.scheduler.max_num_batched_tokens:
            raise ValueError(f"prefill of {T} tokens needs max_num_batched_tokens >= {T}")
        best = math.inf
        for _ in range(repeats):
            add(T, 1)
            dt, _ = _timed_step(eng)
            best = min(best, dt)
            while eng.has_unfinished_requests():
                eng.step()
        ops.append(prefill_step(spec, T, dtype, kv_dtype).timed(best))
        ops[-1] = Op(f"kvserve prefill T={T}", ops[-1].flops, ops[-1].bytes, best)
    for B in decode_batches:
        best, best_ctx = math.inf, context
        for _ in range(repeats):
            for _ in range(B):
                add(context, 4)
            while eng.has_unfinished_requests():
                running = list(eng.scheduler.running)
                decoding = (len(running) == B and not eng.scheduler.waiting
                            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running))
                ctx = sum(r.num_computed_tokens for r in running) / max(len(running), 1)
                dt, _ = _timed_step(eng)
                if decoding and dt < best:
                    best, best_ctx = dt, ctx
        if math.isfinite(best):
            op = decode_step(spec, B, best_ctx, dtype, kv_dtype)
            ops.append(Op(f"kvserve decode B={B} S={int(best_ctx)}", op.flops, op.bytes, best))
    return ops, spec, dtype


def run_serving(llm, requests: list[Request], seed: int = 0) -> dict:
    """Serve `requests` (arrival seconds, prompt and output token counts) on the engine in real time:
    before every step, requests whose arrival has passed are added (fresh random prompts, greedy,
    ignore_eos, exactly `output` tokens); each token's time is the end of the step that made it.
    Returns `simulate.summarize`'s dict (utilization is not measured: nan)."""
    from kvserve import SamplingParams

    eng = llm.engine
    vocab = int(eng.model_config.vocab_size)
    rng = random.Random(seed)
    reqs = sorted((Request(r.rid, r.arrival, r.prompt, r.output) for r in requests), key=lambda r: r.arrival)
    by_id: dict[str, Request] = {}
    seen: dict[str, int] = {}
    done: list[Request] = []
    step_times: list[float] = []
    nxt, start = 0, time.perf_counter()
    while len(done) < len(reqs):
        now = time.perf_counter() - start
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            r = reqs[nxt]
            r.admitted = r.arrival
            rid = f"serve-{seed}-{r.rid}"
            by_id[rid], seen[rid] = r, 0
            eng.add_request(rid, {"prompt_token_ids": _prompt(rng, r.prompt, vocab)},
                            SamplingParams(max_tokens=r.output, temperature=0.0, ignore_eos=True))
            nxt += 1
        if not eng.has_unfinished_requests():
            time.sleep(max(0.0, reqs[nxt].arrival - now))
            continue
        dt, outs = _timed_step(eng)
        step_times.append(dt)
        t = time.perf_counter() - start
        for out in outs:
            r = by_id.get(out.request_id)
            if r is None:
                continue
            n = len(out.outputs[0].token_ids)
            r.token_times.extend([t] * (n - seen[out.request_id]))
            seen[out.request_id] = n
            if out.finished:
                done.append(r)
    return summarize(done, time.perf_counter() - start, len(step_times), math.nan, step_times, len(reqs))
