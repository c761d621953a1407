"""KV tiers below the pool (issue 13; seed 003, "Tiers of KV storage"): reload vs recompute.

    python benchmarks/bench_kv_tiers.py [--quick] [--no-redis] [--out benchmarks/results/kv_tiers.md]

1. Per prompt length T, per tier (CPU memory, local disk, a local Redis server): the time to
   prefill T tokens from scratch (TTFT of a cold prompt, max_tokens=1) against the TTFT of the
   same prompt after its blocks were evicted to the tier and reloaded (the last block is still
   computed), and the reload's own time (fetch + checksum + copy into the pool). Next to them:
   each tier's measured bandwidth, the engine's measured break-even m_KV x Theta_prefill, and
   `kvserve plan preempt`'s analytic break-even for the same model on an H100.
2. Prefill on engine A, decode on engine B, the prompt's K/V handed over through Redis (the
   building block of issue 13 part 3): A's save and B's load against A's prefill time, next to
   seed 003's t_x / t_prefill = m_KV Theta / b and `kvserve plan disagg`'s H100 figure.
3. Seed 003's chat trace (benchmarks/bench_prefix_cache.py, scaled down) under a small pool: the
   prompt-token hit rate without tiers, with a CPU tier, and with a CPU and a disk tier.

Models: stories260K (llama2.c; m_KV = 1,280 bytes/token in float32) for part 1, the random
2-layer Llama of bench_prefix_cache.py for part 2. Times are CPU times of tiny models on a
shared 2-core machine: read them as ratios, not as absolute figures.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve import SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.frontend.llm_engine import LLMEngine  # noqa: E402

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
STORIES_HF = STORIES.parent / "stories260K-hf"
BS = 16
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def start_redis():
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis
    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}"


def ttft(eng, rid, prompt) -> tuple[float, int]:
    eng.add_request(rid, {"prompt_token_ids": prompt}, ONE)
    t0 = time.perf_counter()
    cached = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                cached = o.num_cached_tokens
    return time.perf_counter() - t0, cached


class ReloadTimer:
    """Wraps the connector's fetch (stage_loads) and copy-in (load_blocks) with timers."""

    def __init__(self, conn):
        self.seconds = 0.0
        for name in ("stage_loads", "load_blocks"):
            inner = getattr(conn, name)
            setattr(conn, name, self._wrap(inner))

    def _wrap(self, inner):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            self.seconds += time.perf_counter() - t0
            return out
        return timed


def reload_vs_recompute(model: str, lengths, tiers: dict, reps: int, emit) -> None:
    import random
    rng = random.Random(0)
    emit("| T (tokens) | tier | recompute: cold TTFT (ms) | TTFT after reload (ms) | reload part (ms) | "
         "cached tokens | tier bandwidth (MB/s) | m_KV (B/token) | Theta_prefill (tok/s) | "
         "engine break-even m_KV x Theta (MB/s) | auto rule |")
    emit("|---|---|---|---|---|---|---|---|---|---|---|")
    for T in lengths:
        for name, spec in tiers.items():
            cold, warm, part, cached, bw, be, rule = [], [], [], 0, None, None, None
            eng = LLMEngine(EngineConfig(model=model, device="cpu", block_size=BS,
                                         num_kv_blocks=-(-(T + 1) // BS) + 1, max_num_batched_tokens=1024,
                                         kv_tiers=spec(), kv_tier_reload="always"))
            timer = ReloadTimer(eng.kv.connector)
            ttft(eng, "warmup", [1] + [rng.randrange(3, 500) for _ in range(T - 1)])
            for r in range(reps):
                p = [1] + [rng.randrange(3, 500) for _ in range(T - 1)]
                q = [1] + [rng.randrange(3, 500) for _ in range(T - 1)]
                c, _ = ttft(eng, f"p{r}", p)                 # cold: every token computed
                ttft(eng, f"q{r}", q)                         # evicts p's blocks into the tier
                eng.kv.connector.flush(eng.runner)
                timer.seconds = 0.0
                w, cached = ttft(eng, f"p{r}b", p)            # p again: reloaded from the tier
                cold.append(c)
                warm.append(w)
                part.append(timer.seconds)
            st = eng.stats().kv_tiers
            t0 = st["tiers"][0]
            bw, be = t0["bandwidth"], st["break_even_bandwidth"]
            rule = "reload" if be is None or (bw or 0) > be else "recompute"
            eng.shutdown()
            med = statistics.median
            emit(f"| {T} | {name} | {1e3 * med(cold):.1f} | {1e3 * med(warm):.1f} | {1e3 * med(part):.2f} | "
                 f"{cached} | {bw / 1e6:.0f} | {st['m_kv_bytes_per_token']:.0f} | {st['prefill_tokens_per_s']:.0f} | "
                 f"{be / 1e6:.1f} | {rule} |")


def pd_handoff(name: str, model: str, model_dir: str, lengths, url: str, emit) -> None:
    """Prefill on engine A, decode on engine B, the prompt's K/V handed over through Redis (the
    building block of issue 13 part 3): A's save (copy out, pack, pipelined SET) and B's load
    (GET, checksum, copy in) against A's prefill time, next to seed 003's t_x / t_prefill."""
    import random
    rng = random.Random(1)
    emit(f"| {name}: T | prefill on A (ms) | save on A (ms) | load on B (ms) | KV bytes | transfer MB/s | "
         "transfer / prefill, measured | m_KV Theta / b (seed 003) | B's first token correct |")
    emit("|---|---|---|---|---|---|---|---|---|")
    for T in lengths:
        mk = lambda **kw: LLMEngine(EngineConfig(model=model, device="cpu", block_size=BS, num_kv_blocks=4 * T // BS,  # noqa: E731
                                                  max_num_batched_tokens=1024, kv_tiers=[url], **kw))
        a, b = mk(), mk(kv_tier_reload="always")
        timer = ReloadTimer(b.kv.connector)
        for eng in (a, b):
            ttft(eng, "warm", [1] + [rng.randrange(3, 500) for _ in range(T - 1)])
        p = [1] + [rng.randrange(3, 500) for _ in range(T - 1)]
        a.add_request("p", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        t_prefill, toks = None, None
        while a.has_unfinished_requests():
            for o in a.step():
                if t_prefill is None and o.outputs[0].token_ids:
                    t_prefill = time.perf_counter() - t0
                toks = o.outputs[0].token_ids
        t1 = time.perf_counter()
        a.kv.connector.flush(a.runner)                     # the prompt's blocks into Redis
        t_save = time.perf_counter() - t1
        timer.seconds = 0.0
        b.add_request("d", {"prompt_token_ids": p + toks[:1]},
                      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        got = None
        while b.has_unfinished_requests():
            for o in b.step():
                got = o.outputs[0].token_ids if o.finished else got
        a.add_request("check", {"prompt_token_ids": p + toks[:1]},          # A's own next token
                      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        want = None
        while a.has_unfinished_requests():
            for o in a.step():
                want = o.outputs[0].token_ids if o.finished else want
        st = b.stats().kv_tiers
        nbytes = st["tier_hit_tokens"] * st["m_kv_bytes_per_token"]
        x = t_save + timer.seconds
        theta = a.stats().kv_tiers["prefill_tokens_per_s"] or float("nan")
        emit(f"| {T} | {1e3 * t_prefill:.1f} | {1e3 * t_save:.2f} | {1e3 * timer.seconds:.2f} | {nbytes:,.0f} | "
             f"{nbytes / x / 1e6:.0f} | {x / t_prefill:.3f} | {st['m_kv_bytes_per_token'] * theta / (nbytes / x):.3f} | "
             f"{got == want} |")
        a.shutdown()
        b.shutdown()
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "disagg", "--model", model_dir, "--hw", "h100",
                          "--dtype", "bf16", "--kv-dtype", "fp32", "--link-gbs", "0.5"],
                         capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines()[:1]:
        emit(f"    kvserve plan disagg ({name}, H100 bf16, fp32 KV, 0.5 GB/s link): {line.strip()}")


def planner_line(name: str, model_dir: str, emit) -> None:
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "plan", "preempt", "--model", model_dir,
                          "--hw", "h100", "--dtype", "bf16", "--kv-dtype", "fp32"],
                         capture_output=True, text=True, timeout=120)
    for line in out.stdout.splitlines():
        if "tier reload" in line or "reload from" in line:
            emit(f"    kvserve plan preempt ({name}, H100 bf16, fp32 KV): {line.strip()}")


def smollm_config_dir(tmp: str) -> tuple[str, str]:
    """The default model (SmolLM2-135M, GGUF) and a config.json of its shape for the planner."""
    import json
    from kvserve.config.default_model import default_model_path
    path = default_model_path()
    d = Path(tmp) / "smollm2-config"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
        "tie_word_embeddings": True, "max_position_embeddings": 8192}))
    return str(path), str(d)


def chat_hit_rates(n_conv: int, pool_tokens: int, tmp: str, emit) -> None:
    import bench_prefix_cache as bpc

    bpc.build_model()
    convs = bpc.chat_conversations(n_conv=n_conv, system_len=(200, 600), turns=(1, 4), user_len=(20, 100),
                                   answer_len=(8, 16))
    configs = [("no tier", None), ("cpu:512KiB", ["cpu:512KiB"]),
               ("cpu:512KiB + disk:64MiB", ["cpu:512KiB", f"disk:{tmp}/chat-disk:64MiB"])]
    emit(f"| chat trace ({len(convs)} conversations, pool {pool_tokens} tokens) | hit rate | tier hit tokens | "
         "evictions | mean TTFT (ms) | wall (s) |")
    emit("|---|---|---|---|---|---|")
    for name, tiers in configs:
        r = bpc.run_trace(convs, 8, prefix_cache="hash", num_kv_blocks=pool_tokens // bpc.BLOCK, kv_tiers=tiers)
        st = r["stats"]
        tier_tokens = st.kv_tiers.get("tier_hit_tokens", 0) if st.kv_tiers else 0
        emit(f"| {name} | {100 * r['hit_rate']:.1f}% | {tier_tokens} | {st.num_evictions_total} | "
             f"{1e3 * r['ttft_mean']:.1f} | {r['wall']:.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--no-smollm", action="store_true", help="skip the SmolLM2-135M rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    proc, url = (None, None) if args.no_redis else start_redis()
    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    try:
        n = [0]

        def disk():
            n[0] += 1
            return [f"disk:{tmp}/d{n[0]}:256MiB"]
        tiers = {"cpu": lambda: ["cpu:64MiB"], "disk": disk}
        if url:
            tiers["redis"] = lambda: [url]
        t0 = time.perf_counter()
        emit("`python benchmarks/bench_kv_tiers.py`: CPU, torch 1 thread, a shared 2-core machine under "
             "load (times are noisy; read ratios). Recompute = cold TTFT of T tokens; reload = the same "
             "prompt after its blocks were evicted to the tier (its last block is still computed).")
        emit()
        lengths = [64, 128, 256, 496] if not args.quick else [64, 256]
        reps = 2 if args.quick else 5
        emit("stories260K (llama2.c, float32 weights and KV):")
        emit()
        reload_vs_recompute(str(STORIES), lengths, tiers, reps, emit)
        planner_line("stories260K", str(STORIES_HF), emit)
        if not args.no_smollm:
            gguf, cfg_dir = smollm_config_dir(tmp)
            emit()
            emit("SmolLM2-135M-Instruct (GGUF Q4_1 weights, float32 KV):")
            emit()
            reload_vs_recompute(gguf, lengths[:3], tiers, 2, emit)      # T=496 cold takes seconds here
            planner_line("SmolLM2-135M shape", cfg_dir, emit)
        if url:
            emit()
            emit("Prefill on one engine, decode on another, K/V through Redis (loopback):")
            emit()
            pd_handoff("stories260K", str(STORIES), str(STORIES_HF), [128, 496], url, emit)
            if not args.no_smollm:
                emit()
                pd_handoff("SmolLM2-135M", gguf, cfg_dir, [128, 256], url, emit)
        emit()
        chat_hit_rates(16 if args.quick else 30, 1024, tmp, emit)
        emit()
        emit(f"(total {time.perf_counter() - t0:.0f} s on a shared 2-core machine under load)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
