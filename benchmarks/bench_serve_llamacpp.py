"""`kvserve serve` against llama-server on the same GGUF file, swept over request rates with
`kvserve bench serve` (issue 10): output tok/s, TTFT p50/p99 and ITL p50/p99 per rate per server.

    python benchmarks/bench_serve_llamacpp.py \
        --llama-server /tmp/llamacpp/llama_cpp_python-0.3.36/build/bin/llama-server

    # smoke run (a few minutes):
    python benchmarks/bench_serve_llamacpp.py --llama-server ... --num-prompts 8 --rates 2,inf \
        --out-dir /tmp/serve-llamacpp-smoke

The model is benchmarks/common.py's seeded ~100M random Llama, converted to GGUF bf16 by llama.cpp's
own convert_hf_to_gguf.py (from --llama-cpp-src; cached under --gguf-cache), or `--model smollm2`
(the default model's SmolLM2-135M-Instruct Q4_1 GGUF), or any `--gguf PATH`. The benchmark model's
directory holds stories260K's 512-piece tokenizer.json under a 32000-entry vocabulary; the converter
pads a vocabulary to the config's size only on its SentencePiece path, so the conversion is staged
with stories260K's tok512.model (the same tokenizer) as tokenizer.model (needs `sentencepiece`).

Both servers start on free loopback ports with `--threads` threads: `kvserve serve --model F`
(OMP_NUM_THREADS) and `llama-server -m F -np P -cb -t T -c P*SLOT` (P slots of SLOT tokens each).
Once both answer /health, each gets a short unrecorded warm-up, then, rate by rate, the same
`--num-prompts` prompts of `--input-len` random token ids (sent as token-id lists; a fresh seed per
rate, so no prefix cache can help), `--output-len` tokens each, ignore_eos, streamed, Poisson
arrivals; the server that goes first alternates from rate to rate. Every pass checks the servers'
own usage.prompt_tokens against the requested lengths. Results go to OUT/NAME.{md,png,json}; the
table is printed. Both servers are stopped on exit, Ctrl-C and errors. Timing figures depend on the
machine's load: on a shared 2-core machine they are noisy, so run it when the CPU is quiet.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
DEFAULT_LLAMA_CPP = Path("/tmp/llamacpp/llama_cpp_python-0.3.36")
LABELS = ("kvserve", "llama-server")


def find_llama_server(given: str | None) -> Path:
    for cand in ([given] if given else []) + [os.environ.get("LLAMA_SERVER"),
                                             str(DEFAULT_LLAMA_CPP / "build" / "bin" / "llama-server"),
                                             shutil.which("llama-server")]:
        if cand and Path(cand).is_file():
            return Path(cand)
    raise SystemExit("llama-server not found: build it (cmake --build BUILD --target llama-server) "
                     "and pass --llama-server PATH")


# -- the model file ------------------------------------------------------------------------------
def convert_bench_model(llama_cpp_src: Path, cache: Path) -> Path:
    """benchmarks/common.py's ~100M Llama as GGUF bf16, converted once by convert_hf_to_gguf.py."""
    out = cache / "bench-llama-100m-bf16.gguf"
    if out.is_file():
        return out
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        raise SystemExit("converting the benchmark model needs sentencepiece: pip install sentencepiece")
    from benchmarks.common import SHARED, bench_model_dir

    hf = bench_model_dir()
    script = llama_cpp_src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: pass --llama-cpp-src (llama.cpp's source tree)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            (stage / name).symlink_to(hf / name)
        shutil.copy(SHARED / "models" / "stories260K" / "tok512.model", stage / "tokenizer.model")
        env = dict(os.environ, PYTHONPATH=str(llama_cpp_src / "gguf-py"))
        print(f"converting {hf} to {out} (bf16) with {script}", flush=True)
        subprocess.run([sys.executable, str(script), str(stage), "--outtype", "bf16",
                        "--outfile", str(out) + ".part"], env=env, check=True, capture_output=True)
    os.replace(str(out) + ".part", out)
    return out


def resolve_gguf(args) -> Path:
    if args.gguf:
        return Path(args.gguf)
    if args.model == "smollm2":
        from kvserve.config.default_model import default_model_path

        return Path(default_model_path())
    return convert_bench_model(Path(args.llama_cpp_src), Path(args.gguf_cache))


# -- the servers ---------------------------------------------------------------------------------
class Server:
    """One server subprocess in its own session (so a Ctrl-C reaches it only through stop())."""

    def __init__(self, label: str, cmd: list[str], port: int, env: dict, log_dir: Path):
        self.label, self.cmd, self.port = label, cmd, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{label}.log"
        self._log = open(self.log_path, "wb")
        print(f"starting {label}: {' '.join(cmd)}", flush=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.label} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(self.base_url + "/health", timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)   # its own group: the server and its children
                self.proc.wait()
        self._log.close()


def start_servers(args, gguf: Path, log_dir: Path, servers: dict[str, Server]) -> None:
    """Start both into `servers` (filled as they start, so that a failure still stops the first)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), NO_PROXY="*")
    kv_cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(gguf), "--host", "127.0.0.1",
              "--log-level", "warning", "--dtype", args.kvserve_dtype]
    help_text = subprocess.run(kv_cmd[:4] + ["--help"], capture_output=True, text=True, cwd=ROOT).stdout
    if "--engine-threads" in help_text:
        kv_cmd += ["--engine-threads", str(args.threads)]
    longest = math.ceil((args.input_len + args.output_len) * (1 + args.range_ratio))
    slot = 256 * math.ceil((longest + 16) / 256)
    llama_cmd = [str(args.llama_server), "-m", str(gguf), "-np", str(args.parallel), "-cb",
                 "-t", str(args.threads), "-c", str(args.parallel * slot), "--host", "127.0.0.1"]
    for label, cmd, extra in ((LABELS[0], kv_cmd, args.kvserve_arg), (LABELS[1], llama_cmd, args.llama_arg)):
        port = free_port()
        servers[label] = Server(label, cmd + ["--port", str(port)] + extra, port, env, log_dir)
    deadline = time.monotonic() + args.startup_timeout
    waiting = dict(servers)
    while waiting:
        for label, srv in list(waiting.items()):
            if srv.healthy():
                print(f"{label} is healthy on {srv.base_url}", flush=True)
                del waiting[label]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"{list(waiting)} not healthy after {args.startup_timeout} s:\n" +
                               "\n".join(s.log_tail() for s in waiting.values()))
        time.sleep(0.5)


# -- the passes ----------------------------------------------------------------------------------
def bench_pass(args, gguf: Path, srv: Server, rate: float, seed: int, num_prompts: int, tmp: Path) -> dict:
    """One `kvserve bench serve` pass; returns its summary (the JSON row)."""
    out = tmp / f"{srv.label}-{rate}-{seed}.json"
    cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", srv.base_url,
           "--label", srv.label, "--tokenizer", str(gguf), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio),
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos",
           "--seed", str(seed), "--disable-tqdm", "--save-result", str(out), "--save-detailed"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, NO_PROXY="*", OMP_NUM_THREADS="1"))
    if p.returncode or not out.is_file():
        raise RuntimeError(f"bench serve against {srv.label} failed ({p.returncode}):\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    [row] = json.loads(out.read_text())["runs"][srv.label]
    reqs = row.pop("requests")
    row["extra_chunks"] = sum(r.get("extra_chunks", 0) for r in reqs)
    row["prompt_tokens_per_request"] = sorted({r["prompt_len"] for r in reqs if r["success"]})
    if p.stderr.strip():
        print(p.stderr.strip(), file=sys.stderr, flush=True)
    return row


def sweep(args, gguf: Path, servers: dict[str, Server], tmp: Path) -> dict[str, list[dict]]:
    rates = [float(r) for r in args.rates.split(",")]
    for label, srv in servers.items():     # warm-up: first requests, lazy allocations; not recorded
        bench_pass(args, gguf, srv, math.inf, args.seed + 10_000, 2, tmp)
    rows: dict[str, list[dict]] = {label: [] for label in servers}
    for i, rate in enumerate(rates):
        order = list(servers) if i % 2 == 0 else list(reversed(servers))
        for label in order:
            load_before = os.getloadavg()[0]
            row = bench_pass(args, gguf, servers[label], rate, args.seed + i, args.num_prompts, tmp)
            row["request_rate"] = rate
            # 1-minute load average around the pass (the servers' and the client's own work
            # included): far above the thread count, something else shared the CPUs
            row["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
            rows[label].append(row)
            bad = "" if row["prompt_len_mismatches"] == 0 else \
                f"  PROMPT LENGTH MISMATCHES: {row['prompt_len_mismatches']}"
            print(f"  rate {_rate(rate):>4} {label:13s} out {row['output_throughput']:7.1f} tok/s  "
                  f"TTFT p50/p99 {row['p50_ttft_ms']:7.1f} / {row['p99_ttft_ms']:7.1f} ms  "
                  f"ITL p50/p99 {row['p50_itl_ms']:6.1f} / {row['p99_itl_ms']:6.1f} ms  "
                  f"prompt tokens {row['total_input_tokens']} (requested "
                  f"{row['total_requested_input_tokens']})  failed {row['failed']}  load "
                  f"{row['loadavg_1m'][0]:.1f}->{row['loadavg_1m'][1]:.1f}{bad}", flush=True)
    return rows


def _rate(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def markdown_table(rows: dict[str, list[dict]]) -> str:
    kv, ll = (rows[label] for label in LABELS)
    head = ["rate (req/s)", "kvserve out tok/s", "llama-server out tok/s", "kvserve TTFT p50 / p99 ms",
            "llama-server TTFT p50 / p99 ms", "kvserve ITL p50 / p99 ms", "llama-server ITL p50 / p99 ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a, b in zip(kv, ll):
        lines.append("| " + " | ".join([
            _rate(a["request_rate"]), f"{a['output_throughput']:,.0f}", f"{b['output_throughput']:,.0f}",
            f"{a['p50_ttft_ms']:,.0f} / {a['p99_ttft_ms']:,.0f}", f"{b['p50_ttft_ms']:,.0f} / {b['p99_ttft_ms']:,.0f}",
            f"{a['p50_itl_ms']:,.0f} / {a['p99_itl_ms']:,.0f}", f"{b['p50_itl_ms']:,.0f} / {b['p99_itl_ms']:,.0f}",
        ]) + " |")
    return "\n".join(lines)


def write_results(args, gguf: Path, rows: dict[str, list[dict]], context: dict) -> str:
    from kvserve.bench.report import plot_sweep
    from kvserve.bench.serve import _jsonable

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or ("serve_llamacpp" if not args.gguf and args.model == "bench"
                         else f"serve_llamacpp_{gguf.stem}")
    table = markdown_table(rows)
    mism = {label: sum(r["prompt_len_mismatches"] for r in rs) for label, rs in rows.items()}
    failed = {label: sum(r["failed"] for r in rs) for label, rs in rows.items()}
    spread = f" +/- {100 * args.range_ratio:.0f}%" if args.range_ratio else ""
    note = (f"{gguf.name}; {args.num_prompts} prompts of {args.input_len}{spread} random token ids per rate "
            f"(sent as token ids), {args.output_len}{spread} output tokens, ignore_eos, streamed, Poisson "
            f"arrivals; llama-server `-np {args.parallel} -cb -t {args.threads}`, kvserve "
            f"{args.threads} threads; server order alternating per rate. Prompt-length mismatches "
            f"(server usage vs requested): {mism}; failed requests: {failed}. "
            f"Load average before/after: {context['loadavg_before']} / {context['loadavg_after']} "
            f"on {context['cpus']} CPUs.")
    md = out_dir / f"{name}.md"
    md.write_text(f"{note}\n\n{table}\n")
    png = out_dir / f"{name}.png"
    plot_sweep({label: rs for label, rs in rows.items()}, str(png),
               title=f"kvserve vs llama-server, {gguf.name} ({args.threads} threads each)")
    (out_dir / f"{name}.json").write_text(json.dumps(_jsonable({
        "gguf": str(gguf), "config": {k: str(v) for k, v in vars(args).items()}, "context": context,
        "runs": rows}), indent=1))
    return f"{note}\n\n{table}\n\nwritten: {md}, {png}, {out_dir / (name + '.json')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, "
                    f"{DEFAULT_LLAMA_CPP}/build/bin/llama-server, or on PATH)")
    ap.add_argument("--llama-cpp-src", default=str(DEFAULT_LLAMA_CPP / "vendor" / "llama.cpp"),
                    help="llama.cpp source tree holding convert_hf_to_gguf.py and gguf-py")
    ap.add_argument("--model", choices=["bench", "smollm2"], default="bench",
                    help="bench: benchmarks/common.py's ~100M Llama as bf16 GGUF; smollm2: the default model")
    ap.add_argument("--gguf", default=None, help="serve this GGUF file instead")
    ap.add_argument("--gguf-cache", default="/tmp/kvserve-bench-gguf", help="where the converted model is kept")
    ap.add_argument("--rates", default="1,2,4,inf", help="request rates, req/s (inf: all at once)")
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=128, help="prompt tokens (random token ids)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)] (a mixed workload: 144 / 136 / 0.78 "
                         "gives prompts of 32-256 tokens and outputs of 30-242)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server")
    ap.add_argument("--parallel", type=int, default=32, help="llama-server slots (-np)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--kvserve-dtype", default="bfloat16",
                    help="kvserve's activation dtype (bf16 weights stream as bf16, as llama.cpp's do)")
    ap.add_argument("--kvserve-arg", action="append", default=[], help="extra argument of kvserve serve")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra argument of llama-server")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--name", default=None, help="base name of the result files (default serve_llamacpp)")
    args = ap.parse_args()
    args.llama_server = find_llama_server(args.llama_server)
    gguf = resolve_gguf(args)
    print(f"model {gguf}", flush=True)
    # SIGTERM unwinds like Ctrl-C, through the finally that stops both servers (and SIGINT raises
    # KeyboardInterrupt even where a launcher started this script with SIGINT ignored)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    context = {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    servers: dict[str, Server] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serve-llamacpp-") as tmp:
        try:
            start_servers(args, gguf, Path(tmp), servers)
            rows = sweep(args, gguf, servers, Path(tmp))
        except BaseException:
            for srv in servers.values():
                if srv.proc.poll() is not None:
                    print(f"--- {srv.label} log ---\n{srv.log_tail()}", file=sys.stderr)
            raise
        finally:
            for srv in servers.values():
                srv.stop()
            if servers:
                print("both servers stopped", flush=True)
    context["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print("\n" + write_results(args, gguf, rows, context))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: both servers stopped")
