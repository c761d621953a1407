"""The step-time model of seed 003 ("Why batching by request wastes the GPU", "Mixing prefill and
decode in one step", "When memory runs out") and its calibration against measured step times.

Seed 003's constants, for a replica of n_gpu GPUs (peak pi FLOP/s and bandwidth beta bytes/s each):
    t_W = M_W / (n_gpu beta)                 weight read, s
    t_K = T_bar m_KV / (n_gpu beta)          one sequence's cache read at mean context T_bar, s
    t_F = (2 N_act + 4 L d_attn T_bar) / (n_gpu pi)   one sequence's arithmetic, s
    t_N = 2 N_act / (n_gpu pi)               t_F without its attention term, s
    t_0                                      fixed overhead per step, s
A decode step of B sequences takes  t(B) = max(t_W + B t_K, B t_F) + t_0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .kvmath import kv_bytes_per_token
from .roofline import prefill_flops
from .specs import HardwareSpec, ModelSpec


@dataclass
class StepModel:
    """Seed 003's step-time model for one model on one replica.

    mfu: fraction of peak the arithmetic achieves in prefill (seed 003: "often about half").
    decode_mfu: fraction of peak for decode-token arithmetic (1.0: the seed's t_F uses pi).
    c_half: chunk-efficiency knee (tokens). If > 0, a step that carries c prefill tokens runs its
        prefill arithmetic at mfu * c / (c + c_half) -- an assumption that models the seed's remark that
        "a small chunk gives the linear layers too few tokens to be compute-bound on their own"; 0 = off.
    """
    model: ModelSpec
    hw: HardwareSpec
    n_gpu: int = 1
    dtype: str = "bf16"
    kv_dtype: str = "bf16"
    mfu: float = 0.5
    decode_mfu: float = 1.0
    t0: float = 0.0
    c_half: float = 0.0

    # -- seed 003 constants -------------------------------------------------------------------------
    @property
    def pi(self) -> float:
        return self.hw.peak(self.dtype)

    @property
    def beta(self) -> float:
        return self.hw.bandwidth

    @property
    def m_kv(self) -> float:
        """m_KV, bytes of KV per token."""
        return kv_bytes_per_token(self.model, self.kv_dtype)

    @property
    def t_W(self) -> float:
        """t_W = M_W / (n_gpu beta), s."""
        return self.model.weight_bytes(self.dtype) / (self.n_gpu * self.beta)

    def t_K(self, context: float) -> float:
        """t_K = T_bar m_KV / (n_gpu beta), s, for one sequence at `context` cached tokens."""
        return context * self.m_kv / (self.n_gpu * self.beta)

    @property
    def t_N(self) -> float:
        """t_N = 2 N_act / (n_gpu pi), s per token of weight arithmetic at peak."""
        return 2.0 * self.model.n_act / (self.n_gpu * self.pi)

    def t_F(self, context: float) -> float:
        """t_F = (2 N_act + 4 L d_attn T_bar) / (n_gpu pi decode_mfu), s per decoding sequence."""
        m = self.model
        return (2.0 * m.n_act + 4.0 * m.n_layers * m.d_attn * context) / (self.n_gpu * self.pi * self.decode_mfu)

    # -- decode step, knee, budget ------------------------------------------------------------------
    def decode_step_time(self, batch: float, context: float) -> float:
        """Seed 003: t(B) = max(t_W + B t_K, B t_F) + t_0, seconds, all B sequences at `context`."""
        return max(self.t_W + batch * self.t_K(context), batch * self.t_F(context)) + self.t0

    def knee_batch(self, context: float = 0.0) -> float:
        """Seed 003 (the knee of section 20.1): the B where t_W + B t_K = B t_F, i.e.
        B* = t_W / (t_F - t_K); with t_K = 0 and no attention term, B* = s_W pi / (2 beta)."""
        tf, tk = self.t_F(context), self.t_K(context)
        return math.inf if tf <= tk else self.t_W / (tf - tk)

    def chunk_budget(self, batch: int, context: float = 0.0) -> float:
        """Seed 003: the prefill tokens C a decode step of B sequences carries for free,
        C* = (t_W + B t_K) / t_N - B (with t_K = 0, C* = B* - B)."""
        return (self.t_W + batch * self.t_K(context)) / self.t_N - batch

    # -- prefill ------------------------------------------------------------------------------------
    def prefill_efficiency(self, chunk_tokens: float) -> float:
        if self.c_half <= 0:
            return self.mfu
        return self.mfu * chunk_tokens / (chunk_tokens + self.c_half)

    def prefill_time(self, n_tokens: float, cached: float = 0.0) -> float:
        """Seed 003: prefill of T tokens at a given MFU, (2 N_act T + 2 L d_attn T^2) / (n_gpu pi MFU),
        seconds (compute-bound; with `cached` prefix tokens, see roofline.prefill_flops)."""
        return prefill_flops(self.model, n_tokens, cached) / (
            self.n_gpu * self.pi * self.prefill_efficiency(n_tokens))

    # -- a general mixed step -----------------------------------------------------------------------
    def step_time(self, decode_contexts=(), chunks=()) -> float:
        """One packed step (seed 003, "Mixing prefill and decode in one step"): the slower of reading
        memory (weights once, every decoding sequence's cache, every chunk's cached prefix) and doing
        arithmetic (decode tokens at decode_mfu, prefill chunks at mfu), plus t_0.

        decode_contexts: cached tokens of each decoding sequence; chunks: (n_new, n_cached) pairs.
        """
        ctx = float(np.sum(decode_contexts)) if len(decode_contexts) else 0.0
        n_dec = len(decode_contexts)
        m = self.model
        mem = self.model.weight_bytes(self.dtype) + ctx * self.m_kv
        dec_flops = 2.0 * m.n_act * n_dec + 4.0 * m.n_layers * m.d_attn * ctx
        pre_flops, pre_tokens = 0.0, 0
        for n_new, n_cached in chunks:
            mem += n_cached * self.m_kv
            pre_flops += prefill_flops(m, n_new, n_cached)
            pre_tokens += n_new
        comp = dec_flops / (self.pi * self.decode_mfu)
        if pre_tokens:
            comp += pre_flops / (self.pi * self.prefill_efficiency(pre_tokens))
        return max(mem / self.beta, comp) / self.n_gpu + self.t0

    # -- a workload ---------------------------------------------------------------------------------
    def workload(self, batch: int, T_in: float, T_out: float) -> dict:
        """TTFT, TPOT and step times for B concurrent requests of T_in prompt and T_out output tokens
        (no queueing): TTFT = prefill time alone; TPOT = decode step at the mean context
        T_in + T_out / 2; aggregate throughput B / TPOT (seed 001's latency vocabulary)."""
        ctx = T_in + T_out / 2
        tpot = self.decode_step_time(batch, ctx)
        ttft = self.prefill_time(T_in) + self.t0
        return {
            "batch": batch, "T_in": T_in, "T_out": T_out,
            "ttft_s": ttft, "tpot_s": tpot,
            "ttlt_s": ttft + tpot * (T_out - 1),  # seed 000: TTLT = TTFT + TPOT (n - 1)
            "step_first_s": self.decode_step_time(batch, T_in),
            "step_last_s": self.decode_step_time(batch, T_in + T_out),
            "tokens_per_s": batch / tpot,
            "bound": "memory" if self.t_W + batch * self.t_K(ctx) >= batch * self.t_F(ctx) else "compute",
            "knee_batch": self.knee_batch(ctx),
        }


# --------------------------------------------------------------------------------------------------
# calibration
# --------------------------------------------------------------------------------------------------
@dataclass
class StepFit:
    """Fitted step-time parameters (seconds): t = t0 + max(t_W + t_kv * ctx_sum, t_tok * n_tokens).

    t_kv is the cache-read time per cached token (t_K = T_bar * t_kv), t_tok the arithmetic time per
    scheduled token. `rel_rmse` and `max_rel_err` measure the fit on its own samples.
    """
    t0: float
    t_W: float
    t_kv: float
    t_tok: float
    rel_rmse: float
    max_rel_err: float
    n_memory: int
    n_compute: int
    t_seq: float = 0.0   # per scheduled sequence (fit_step_model(..., n_seqs=...)); 0 = seed 003's form

    def predict(self, n_tokens, ctx_sum, n_seqs=0):
        n_tokens, ctx_sum = np.asarray(n_tokens, float), np.asarray(ctx_sum, float)
        return (self.t0 + self.t_seq * np.asarray(n_seqs, float)
                + np.maximum(self.t_W + self.t_kv * ctx_sum, self.t_tok * n_tokens))


def _nnls(A: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients by active-set elimination (tiny problems)."""
    active = list(range(A.shape[1]))
    x = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active], y, rcond=None)
        if np.all(sol >= 0):
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def fit_step_model(n_tokens, ctx_sum, step_s, iters: int = 50, n_seqs=None) -> StepFit:
    """Fit seed 003's t(B) = max(t_W + B t_K, B t_F) + t_0 to measured steps, generalised to mixed
    steps as t = t_0 + max(t_W + t_kv * ctx_sum, t_tok * n_tokens).

    n_tokens: tokens scheduled in each step [n]; ctx_sum: cached tokens read by each step [n];
    step_s: measured step time [n], seconds. The fit alternates between assigning each sample to the
    memory or the compute branch of the max and solving the (then linear) non-negative least squares
    problem in relative error (each residual divided by its measured time), from several starting
    splits, and keeps the best. A branch with no samples has its
    parameters reported as 0 (not identifiable from the data). With `n_seqs` (sequences scheduled in
    each step [n]) the fit adds a per-sequence cost outside the max, t_seq * n_seqs (sampling, block
    tables and per-sequence attention launches: an extension of the seed's form).
    """
    n = np.asarray(n_tokens, float)
    c = np.asarray(ctx_sum, float)
    y = np.asarray(step_s, float)
    seqs = np.zeros_like(y) if n_seqs is None else np.asarray(n_seqs, float)
    if not (len(n) == len(c) == len(y) == len(seqs)) or len(y) < 3:
        raise ValueError("fit_step_model needs at least 3 samples of equal-length n_tokens, ctx_sum, step_s")
    if np.any(y <= 0):
        raise ValueError("step times must be positive")
    w = y  # weights: minimise the relative error of each step
    best = None
    starts = [np.zeros(len(y), bool), np.ones(len(y), bool)]
    # compute regime = the samples with the most tokens (absolute, or per cached token read)
    for key in (n, n / (c + c.mean() + 1.0)):
        order = np.argsort(key)
        for q in np.arange(0.05, 1.0, 0.05):
            s = np.zeros(len(y), bool)
            s[order[int(q * len(y)):]] = True
            starts.append(s)
    for comp in starts:
        for _ in range(iters):
            A = np.column_stack([np.ones_like(y), ~comp, np.where(comp, 0.0, c), np.where(comp, n, 0.0)]
                                + ([seqs] if n_seqs is not None else []))
            p = _nnls(A / w[:, None], y / w)  # relative least squares: every step counts alike
            t0, tW, tkv, ttok = p[:4]
            tseq = p[4] if n_seqs is not None else 0.0
            new = ttok * n > tW + tkv * c
            if np.array_equal(new, comp):
                break
            comp = new
        pred = t0 + tseq * seqs + np.maximum(tW + tkv * c, ttok * n)
        sse = float(np.sum(((pred - y) / w) ** 2))
        if best is None or sse < best[0]:
            best = (sse, p, comp.copy(), pred)
    _, p, comp, pred = best
    t0, tW, tkv, ttok = p[:4]
    rel = (pred - y) / y
    return StepFit(float(t0), float(tW), float(tkv), float(ttok), float(np.sqrt(np.mean(rel**2))),
                   float(np.max(np.abs(rel))), int((~comp).sum()), int(comp.sum()),
                   float(p[4]) if n_seqs is not None else 0.0)


def calibrate_engine(model_path: str, batch_sizes=(1, 2, 4, 8, 16), prompt_lens=(8, 32, 128), n_decode: int = 12,
                     engine_kwargs: dict | None = None, seed: int = 0,
                     repeats: int = 3, llm=None, trim: float | None = None,
                     envelope: float | None = None, statistic: str = "min",
                     per_seq: bool = False) -> tuple[StepFit, list[dict]]:
    """Time real engine steps (kvserve.LLM / LLMEngine) and fit the step model to them.

    For each (batch, prompt length) it adds `batch` requests of random prompt tokens that generate
    `n_decode` tokens (ignore_eos), then calls `engine.step()` until they finish, timing every step
    and recording its composition from the scheduler's output: tokens scheduled and cached tokens the
    step reads (sum of num_computed_tokens before the step). The samples go to `fit_step_model`.
    Every configuration runs `repeats` times (same random prompts) and each distinct step keeps its
    fastest time. Imports kvserve lazily; raises ImportError if the engine is not importable.
    `llm`: an already built kvserve.LLM to time instead of building one from model_path. `trim`: refit
    without steps slower than (1 + trim) x the prediction (`trim_slow_steps`); `envelope`: keep the
    fastest of nearly identical steps (`lower_envelope`). Both are for loaded machines. `statistic`
    'median' keeps the median of identical (and, with `envelope`, nearly identical) steps instead of
    the fastest: the engine as it runs under the machine's current load. `per_seq`: fit a cost per
    scheduled sequence too (StepFit.t_seq).
    """
    import random
    import time as _time

    from kvserve import LLM, SamplingParams  # lazy: the engine is a separate part of kvserve

    llm = llm if llm is not None else LLM(model=model_path, **(engine_kwargs or {}))
    eng = llm.engine
    orig_schedule = eng.scheduler.schedule
    current: dict = {}

    def recording_schedule(*a, **kw):
        out = orig_schedule(*a, **kw)
        current["n_tokens"] = sum(n for _, n in out.scheduled)
        current["ctx_sum"] = sum(req.num_computed_tokens for req, _ in out.scheduled)
        current["n_seqs"] = len(out.scheduled)
        return out

    eng.scheduler.schedule = recording_schedule
    vocab = int(getattr(eng.model_config, "vocab_size", 512))
    samples, rid = [], 0
    try:
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        eng.add_request("calib-warmup", {"prompt_token_ids": [3] * max(prompt_lens)}, warm)
        while eng.has_unfinished_requests():
            eng.step()
        for rep, P, B in [(k, P, B) for k in range(repeats) for P in prompt_lens for B in batch_sizes]:
            params = SamplingParams(max_tokens=n_decode, temperature=0.0, ignore_eos=True)
            # fresh random prompts every repeat, so a prefix cache cannot change the step composition
            rng = random.Random(((seed * 1_000_003 + rep) * 1009 + P) * 1009 + B)
            for _ in range(B):
                ids = [rng.randrange(3, vocab) for _ in range(P)]
                eng.add_request(f"calib-{rid}", {"prompt_token_ids": ids}, params)
                rid += 1
            while eng.has_unfinished_requests():
                current.clear()
                t0 = _time.perf_counter()
                eng.step()
                dt = _time.perf_counter() - t0
                if current.get("n_tokens"):
                    samples.append({"n_tokens": current["n_tokens"], "ctx_sum": current["ctx_sum"],
                                    "n_seqs": current["n_seqs"], "step_s": dt, "B": B, "P": P})
    finally:
        eng.scheduler.schedule = orig_schedule
    # the same step composition measured `repeats` times: keep the fastest (other load on the machine
    # only ever adds time)
    groups: dict = {}
    for s in samples:
        groups.setdefault((s["n_tokens"], s["ctx_sum"], s["n_seqs"]), []).append(s)
    samples = [_pick(g, statistic) for g in groups.values()]
    if envelope:
        samples = lower_envelope(samples, envelope, statistic)
    fit = fit_step_model([s["n_tokens"] for s in samples], [s["ctx_sum"] for s in samples],
                         [s["step_s"] for s in samples],
                         n_seqs=[s["n_seqs"] for s in samples] if per_seq else None)
    if trim:
        fit, samples = trim_slow_steps(fit, samples, trim, per_seq=per_seq)
    return fit, samples


def _pick(group: list[dict], statistic: str) -> dict:
    """The fastest step of a group ('min'), or its median step ('median')."""
    ranked = sorted(group, key=lambda x: x["step_s"])
    if statistic == "min":
        return ranked[0]
    if statistic == "median":
        return ranked[(len(ranked) - 1) // 2]
    raise ValueError(f"statistic must be 'min' or 'median', not {statistic!r}")


def lower_envelope(samples: list[dict], rel: float, statistic: str = "min") -> list[dict]:
    """Merge steps of the same composition (tokens scheduled, sequences) whose cached tokens read differ
    by less than a factor 1 + rel (consecutive decode steps of one batch), keeping the fastest of each
    group: the best of many nearly identical steps, where a loaded machine adds time to most of them
    (statistic 'median': the group's median step instead, what the engine takes under the load)."""
    out, group = [], []
    for s in sorted(samples, key=lambda s: (s["n_tokens"], s.get("n_seqs", 0), s["ctx_sum"])):
        if group and (s["n_tokens"], s.get("n_seqs", 0)) == (group[0]["n_tokens"], group[0].get("n_seqs", 0)) \
                and s["ctx_sum"] <= (1 + rel) * group[0]["ctx_sum"]:
            group.append(s)
            continue
        if group:
            out.append(_pick(group, statistic))
        group = [s]
    if group:
        out.append(_pick(group, statistic))
    return out


def trim_slow_steps(fit: StepFit, samples: list[dict], trim: float, rounds: int = 3,
                    keep: float = 0.6, per_seq: bool = False) -> tuple[StepFit, list[dict]]:
    """Refit without the steps that took more than (1 + trim) x the fit's prediction. On a shared
    machine other processes only ever add time to a step, so such steps measure the neighbours, not the
    engine; the error is one-sided and so is the trimming. Up to `rounds` rounds, never below `keep` of
    the samples. Each kept sample gets "trimmed": False; the dropped ones are returned with True."""
    kept, dropped = list(samples), []
    for _ in range(rounds):
        pred = fit.predict([s["n_tokens"] for s in kept], [s["ctx_sum"] for s in kept],
                           [s.get("n_seqs", 0) for s in kept])
        slow = [s for s, p in zip(kept, pred) if s["step_s"] > (1 + trim) * p]
        if not slow or len(kept) - len(slow) < max(3, keep * len(samples)):
            break
        dropped += slow
        kept = [s for s, p in zip(kept, pred) if s["step_s"] <= (1 + trim) * p]
        fit = fit_step_model([s["n_tokens"] for s in kept], [s["ctx_sum"] for s in kept],
                             [s["step_s"] for s in kept],
                             n_seqs=[s["n_seqs"] for s in kept] if per_seq else None)
    return fit, [dict(s, trimmed=False) for s in kept] + [dict(s, trimmed=True) for s in dropped]
