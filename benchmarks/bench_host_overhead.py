"""Host-side time per engine step (everything but the forward pass) with long streamed outputs.

Issue 22's aim: at batch 1, 64 and 256, with 1,024-token outputs streamed through `kvserve
serve` (the engine core in its own process), the host time per step is flat in output length
and, at batch 256, at most half of the baseline's.

How it measures. The model is a random-weight Llama of width 64 and 2 layers with the
stories260K tokenizer (vocab 512: every id decodes to text), so the forward pass is small and
the host work is most of a step. One server per tree and repeat; after a warm-up, B requests
of P random prompt tokens each (`min_tokens` = `max_tokens` = N, `ignore_eos`, greedy, streamed
with usage) are sent at once and their SSE streams drained with httpx; every stream must report
N completion tokens. In the engine core, `host_overhead_hook/sitecustomize.py` (on PYTHONPATH,
enabled by KVSERVE_HOST_OVERHEAD_DIR) timestamps every `ModelRunner.forward` and every engine
`step`. Per step:

    between forwards = start of the next forward - end of this one: everything the core does
                       between two forward passes (schedule, pack inputs, sample, outputs, deltas,
                       pickling, the pipe to the API process), whichever function does it; also
                       any wait for a CPU (the API process and this client share the 2 cores)
                       or for room in a full pipe
    in <X>.step()    = the engine step's time - its forward time (where the tree has a `step`)

A step's output position is that of its decode rows (their token position - P + 1). Reported per
batch: host ms per step over output positions [0, N/8), [N/2 - N/16, N/2 + N/16), [7N/8, N)
(0-128, 448-576, 896-1024 for N = 1024) and over all steps, forward ms per step, the API
process's CPU time per streamed token (the server's main process: HTTP, SSE, JSON and, after the
rewrite, detokenization), the core's and this client's CPU per token, output tok/s, and, since
the CPU is shared, the load average around each run and the cores other processes used during
it (the machine's busy CPU time less this benchmark's three processes', over the wall time).
Medians over repeats (batches above 64 run once unless --large-repeats says more: 256 x 1,024
tokens takes ~3 min on 2 cores); with --baseline-tree the two trees alternate (the order
flipping each repeat) on fresh servers and the ratios tree / baseline are printed.

    git worktree add --detach /tmp/kvserve-base f6a0342
    python benchmarks/bench_host_overhead.py --baseline-tree /tmp/kvserve-base \\
        --out benchmarks/results/host_overhead.json
    python benchmarks/bench_host_overhead.py --tree /tmp/kvserve-base \\
        --out benchmarks/results/host_overhead_baseline.json        # one tree alone
    python benchmarks/bench_host_overhead.py --tree /tmp/kv --baseline-tree /tmp/kv \
        --server-args --async-scheduling                            # one tree, a flag on and off
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch

from common import free_port

HERE = Path(__file__).resolve().parent
HOOK_DIR = HERE / "host_overhead_hook"
SHARED = HERE.parents[1] / "shared"
MODEL_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                    rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.15,
                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
BLOCK_SIZE = 16


def model_dir(path: Path) -> Path:
    """Build (once) the benchmark model: random weights (seed 0), float32, stories260K tokenizer."""
    if (path / "model.safetensors").exists():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHARED / "models" / "stories260K-hf" / name, path / name)
    return path


def tree_info(tree: Path) -> dict:
    def git(*a):
        return subprocess.run(["git", "-C", str(tree), *a], capture_output=True, text=True).stdout.strip()
    dirty = [line for line in git("status", "--porcelain", "--", "kvserve").splitlines() if line]
    commit = git("rev-parse", "--short", "HEAD")
    return {"path": str(tree), "commit": commit, "dirty_kvserve_files": len(dirty),
            "label": commit + ("+dirty" if dirty else "")}


class Server:
    """`kvserve serve` from `tree` (its kvserve first on PYTHONPATH, then the hook's folder)."""

    def __init__(self, tree: Path, model: Path, max_num_seqs: int, num_kv_blocks: int, args, extra=()):
        self.log_dir = Path(tempfile.mkdtemp(prefix="kvserve-host-overhead-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, NO_PROXY="*", KVSERVE_HOST_OVERHEAD_DIR=str(self.log_dir),
                   PYTHONPATH=os.pathsep.join([str(tree), str(HOOK_DIR)]))
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), "--dtype", "float32",
               "--port", str(self.port), "--log-level", "warning", "--served-model-name", "bench",
               "--max-num-seqs", str(max_num_seqs), "--num-kv-blocks", str(num_kv_blocks),
               "--block-size", str(BLOCK_SIZE), "--no-enable-prefix-caching"]
        if args.engine_threads:
            cmd += ["--engine-threads", str(args.engine_threads)]
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve ({tree}) exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvserve serve did not become healthy within 300 s")
            time.sleep(0.3)
        self.api = psutil.Process(self.proc.pid)

    def cpu_s(self) -> tuple[float, float]:
        """(API process, engine core and any other children) CPU seconds so far."""
        def cpu(p):
            t = p.cpu_times()
            return t.user + t.system
        return cpu(self.api), sum(cpu(c) for c in self.api.children(recursive=True))

    def stop(self) -> list[list]:
        """Graceful shutdown (the core exits and closes its log), then the hook's records."""
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        records = []
        for f in self.log_dir.glob("*.jsonl"):
            records += [json.loads(line) for line in f.read_text().splitlines()]
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return records


async def stream_all(url: str, prompts: list[list[int]], n_out: int) -> None:
    """Send every request at once and drain the SSE streams; each must report n_out tokens."""
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(1800), limits=limits,
                                 trust_env=False) as client:
        async def one(prompt: list[int]) -> None:
            body = {"model": "bench", "prompt": prompt, "max_tokens": n_out, "min_tokens": n_out,
                    "ignore_eos": True, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            tail = b""
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for chunk in r.aiter_bytes():
                    tail = (tail + chunk)[-4096:]
            events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: ")]
            usage = json.loads(events[-2][6:]).get("usage") if len(events) >= 2 else None
            if events[-1:] != [b"data: [DONE]"] or not usage or usage["completion_tokens"] != n_out:
                raise RuntimeError(f"stream did not end with {n_out} tokens: {tail[-400:]!r}")
        await asyncio.gather(*(one(p) for p in prompts))


def prompts_for(batch: int, args, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL_CONFIG["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(batch)]


def bands(n_out: int) -> list[tuple[int, int]]:
    return [(0, n_out // 8), (n_out // 2 - n_out // 16, n_out // 2 + n_out // 16), (n_out - n_out // 8, n_out)]


def analyse(records: list[list], t_start: float, t_end: float, args) -> dict:
    """Per-step host times from the hook's records inside [t_start, t_end]: between forwards
    (`host_ms*`) and inside each wrapped step function (`<name>_host_ms*`)."""
    fwd = sorted(r[1:] for r in records if r[0] == "f" and t_start <= r[1] <= t_end)
    if len(fwd) < 2:
        raise RuntimeError("the hook recorded no forward passes: is ModelRunner.forward still where "
                           "host_overhead_hook/sitecustomize.py looks for it?")
    starts = [f[0] for f in fwd]
    pos_of = [max((first + last) // 2 - args.prompt_len + 1, 0) if nd else 0
              for _, _, _, nd, first, last in fwd]
    # (output position, decode rows, forward s, host s until the next forward)
    rows = [(pos_of[i], fwd[i][3], fwd[i][1] - fwd[i][0], fwd[i + 1][0] - fwd[i][1])
            for i in range(len(fwd) - 1)]
    out = {"steps": len(fwd), "forward_ms": 1e3 * statistics.mean(r[2] for r in rows)}
    out.update(banded("host_ms", [(r[0], r[3]) for r in rows], args))
    for lo, hi in bands(args.output_len):
        sel = [r[1] for r in rows if lo <= r[0] < hi]
        out[f"decode_rows_{lo}_{hi}"] = statistics.mean(sel) if sel else None
    for name in sorted({r[3] for r in records if r[0] == "s"}):
        inner = []      # (output position, step time - the forwards inside it)
        for s0, s1 in sorted(r[1:3] for r in records if r[0] == "s" and r[3] == name and t_start <= r[1] <= t_end):
            i = bisect.bisect_left(starts, s0)
            j = bisect.bisect_right(starts, s1)
            inside = [k for k in range(i, j) if fwd[k][1] <= s1]
            if inside:
                inner.append((pos_of[inside[-1]], s1 - s0 - sum(fwd[k][1] - fwd[k][0] for k in inside)))
        if inner:
            out.update(banded(f"{name}_host_ms", inner, args))
    return out


def banded(key: str, pairs: list[tuple[int, float]], args) -> dict:
    """Mean ms of (output position, seconds) pairs: over all, and per position band."""
    out = {key: 1e3 * statistics.mean(v for _, v in pairs)}
    for lo, hi in bands(args.output_len):
        sel = [v for p, v in pairs if lo <= p < hi]
        out[f"{key}_{lo}_{hi}"] = 1e3 * statistics.mean(sel) if sel else None
    return out


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all cores)."""
    t = psutil.cpu_times()
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def run_batch(server: Server, batch: int, args, seed: int) -> tuple[dict, float, float]:
    prompts = prompts_for(batch, args, seed)
    load0 = os.getloadavg()[0]
    api0, core0 = server.cpu_s()
    client0, busy0 = time.process_time(), busy_cpu_s()
    t_start = time.perf_counter()
    asyncio.run(stream_all(server.url, prompts, args.output_len))
    t_end = time.perf_counter()
    api1, core1 = server.cpu_s()
    client1, busy1 = time.process_time(), busy_cpu_s()
    tokens = batch * args.output_len
    ours = (api1 - api0) + (core1 - core0) + (client1 - client0)
    fig = {"tok_s": tokens / (t_end - t_start), "wall_s": t_end - t_start,
           "api_cpu_us_per_token": 1e6 * (api1 - api0) / tokens,
           "core_cpu_us_per_token": 1e6 * (core1 - core0) / tokens,
           "client_cpu_us_per_token": 1e6 * (client1 - client0) / tokens,
           "other_cpu_cores": max(busy1 - busy0 - ours, 0.0) / (t_end - t_start),
           "load_before": load0, "load_after": os.getloadavg()[0]}
    return fig, t_start, t_end


def one_server(tree: Path, model: Path, args, rep: int, extra=()) -> dict[int, dict]:
    """A fresh server on `tree`: warm up, then each batch in turn; figures per batch."""
    max_b = max(args.batches)
    blocks = max_b * -(-(args.prompt_len + args.output_len + 1) // BLOCK_SIZE) + 64
    server = Server(tree, model, max_b, blocks, args, extra)
    windows, figs = {}, {}
    try:
        asyncio.run(stream_all(server.url, prompts_for(min(max_b, 16), args, 10_000 + rep), 32))
        for b in args.batches:
            if b > args.large_batch and rep >= args.large_repeats:
                continue
            fig, t0, t1 = run_batch(server, b, args, seed=1000 * rep + b)
            figs[b], windows[b] = fig, (t0, t1)
            print(f"  batch {b}: {fig['tok_s']:.0f} tok/s in {fig['wall_s']:.1f} s, load "
                  f"{fig['load_before']:.2f}->{fig['load_after']:.2f}, other processes "
                  f"{fig['other_cpu_cores']:.2f} cores", flush=True)
    finally:
        records = server.stop()
    modules = sorted({(r[1], r[2]) for r in records if r[0] == "module"})
    stray = [f for _, f in modules if not Path(f).resolve().is_relative_to(tree.resolve())]
    if stray:
        raise RuntimeError(f"the server ran kvserve from outside {tree}: {stray}")
    for b, (t0, t1) in windows.items():
        figs[b].update(analyse(records, t0, t1, args))
        figs[b]["modules"] = modules
    return figs


def median_figs(runs: list[dict]) -> dict:
    keys = dict.fromkeys(k for r in runs for k, v in r.items() if isinstance(v, (int, float)))
    med = {k: statistics.median(r[k] for r in runs if r.get(k) is not None) for k in keys}
    med["repeats"] = len(runs)
    return med


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(medians: dict, args) -> str:
    """One row per tree and batch: host ms/step between forwards and inside step(), per band."""
    bs = bands(args.output_len)
    names = sorted({k[:-len("_host_ms")] for per in medians.values() for m in per.values() for k in m
                    if k.endswith("_host_ms") and k != "host_ms"})
    groups = [("host_ms", "between forwards")] + [(f"{n}_host_ms", f"in {n}()") for n in names]
    cols = [(f"{key}_{lo}_{hi}", f"{what} @{lo}-{hi}") for key, what in groups for lo, hi in bs + [(None, None)]]
    cols = [(k.replace("_None_None", ""), h.replace(" @None-None", " all")) for k, h in cols]
    cols += [("forward_ms", "forward ms"), ("api_cpu_us_per_token", "API CPU us/tok"),
             ("core_cpu_us_per_token", "core CPU us/tok"), ("client_cpu_us_per_token", "client CPU us/tok"),
             ("tok_s", "tok/s")]
    lines = ["| tree | batch | " + " | ".join(h for _, h in cols)
             + " | load (1 min) | others' CPU (cores) | repeats |", "|" + "---|" * (len(cols) + 5)]
    for label, per_batch in medians.items():
        for b, m in per_batch.items():
            cells = [fmt(m.get(k), ".0f" if k == "tok_s" else ".1f" if "us_per" in k else ".2f") for k, _ in cols]
            lines.append(f"| {label} | {b} | " + " | ".join(cells) +
                         f" | {fmt(m.get('load_before'))}-{fmt(m.get('load_after'))}"
                         f" | {fmt(m.get('other_cpu_cores'))} | {m['repeats']} |")
    return "host ms/step\n" + "\n".join(lines)


def ratios(medians: dict, tree: str, base: str, args) -> str:
    keys = [f"host_ms_{lo}_{hi}" for lo, hi in bands(args.output_len)] + ["host_ms", "api_cpu_us_per_token", "tok_s"]
    lines = [f"| batch | {' | '.join(keys)} |", "|" + "---|" * (len(keys) + 1)]
    for b in medians[tree]:
        t, s = medians[tree][b], medians[base].get(b, {})
        cells = [fmt(t[k] / s[k]) if t.get(k) and s.get(k) else "-" for k in keys]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return f"ratios {tree} / {base}\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", type=Path, default=HERE.parent, help="checkout to measure (default: this one)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a second checkout (e.g. a git worktree of the baseline commit), run interleaved")
    ap.add_argument("--server-args", default="", help="more `kvserve serve` flags for --tree (e.g. --async-scheduling)")
    ap.add_argument("--baseline-server-args", default="", help="more `kvserve serve` flags for --baseline-tree")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--large-batch", type=int, default=64,
                    help="batches above this run only --large-repeats times (time on 2 cores)")
    ap.add_argument("--large-repeats", type=int, default=1,
                    help="repeats of the batches above --large-batch (default 1: a 256 x 1024 run takes ~3 min)")
    ap.add_argument("--engine-threads", type=int, default=1,
                    help="torch threads of the engine core (default 1: the API process keeps the other core)")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/kvserve-bench-llama-host-overhead"))
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1,8, 128 tokens, 1 repeat")
    ap.add_argument("--out", type=Path, default=None, help="JSON results (and a .md table beside it)")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.output_len, args.repeats = "1,8", 128, 1
    args.batches = [int(b) for b in args.batches.split(",")]
    model = model_dir(args.model_dir)
    trees = {}
    for path, extra in [(args.tree, args.server_args)] + ([(args.baseline_tree, args.baseline_server_args)]
                                                         if args.baseline_tree else []):
        info = tree_info(path.resolve())
        info["server_args"] = shlex.split(extra)
        label = info["label"] + (f" {extra}" if extra else "")
        trees[label if label not in trees else label + "'"] = info
    labels = list(trees)
    meta = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "load_at_start": os.getloadavg(), "model": MODEL_CONFIG, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "engine_threads": args.engine_threads,
            "trees": trees, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(["python", "benchmarks/bench_host_overhead.py", *sys.argv[1:]])}
    print(f"capability {meta['cpu_capability']}, load {meta['load_at_start']}, trees "
          + ", ".join(f"{k} ({v['path']})" for k, v in trees.items()), flush=True)
    runs: dict[str, dict[int, list[dict]]] = {k: {} for k in labels}
    for rep in range(args.repeats):
        for label in (labels if rep % 2 == 0 else labels[::-1]):
            print(f"[{rep}] {label}", flush=True)
            for b, fig in one_server(Path(trees[label]["path"]), model, args, rep, trees[label]["server_args"]).items():
                runs[label].setdefault(b, []).append(fig)
    medians = {k: {b: median_figs(v) for b, v in sorted(per.items())} for k, per in runs.items()}
    text = (f"host time per step, {args.prompt_len}-token prompts, {args.output_len}-token streamed outputs, "
            f"capability {meta['cpu_capability']}, {meta['cpus']} cpus, engine threads {args.engine_threads}; "
            f"medians\n\n" + table(medians, args))
    if len(labels) == 2:
        text += "\n\n" + ratios(medians, labels[0], labels[1], args)
    print("\n" + text)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "args": {k: str(v) for k, v in vars(args).items()},
                                        "medians": medians, "runs": runs}, indent=1))
        args.out.with_suffix(".md").write_text(f"{meta['started']}: `{meta['command']}`\n\n{text}\n")


if __name__ == "__main__":
    main()
