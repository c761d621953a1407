"""Two tenants, one bursting at 10x the other's rate (issue 15): B's TTFT and each tenant's share
of the tokens served under `--scheduling-policy fcfs` and `vtc`, with `kvserve bench serve
--tenant KEY:RATE:N` against a live server of stories260K (one server per policy, in turn).

    python benchmarks/bench_tenants.py [--rate-b 4] [--n-b 8] [--rounds 2] [--max-num-seqs 2] \\
        [--out benchmarks/results/tenants.md]

Not a timed test: the figures depend on the machine (and its other load), so both policies
run on the same machine in the same run, one after the other, with the same seeded workload.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server.live import STORIES_HF, LiveServer  # noqa: E402


def run(policy: str, args, keys: Path, out_json: Path) -> dict:
    srv = LiveServer("--api-keys", str(keys), "--scheduling-policy", policy,
                     "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", "256")
    try:
        cmd = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", srv.base_url,
               "--tokenizer", str(STORIES_HF), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--ignore-eos", "--disable-tqdm", "--seed", "0", "--api-key", "key-a",
               "--tenant", f"key-a:{10 * args.rate_b:g}:{10 * args.n_b}",
               "--tenant", f"key-b:{args.rate_b:g}:{args.n_b}", "--save-result", str(out_json)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), NO_PROXY="*")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
        print(proc.stdout.split("contention window")[-1])
        return json.loads(out_json.read_text())
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate-b", type=float, default=4.0, help="tenant B's request rate (A: 10x)")
    ap.add_argument("--n-b", type=int, default=8, help="tenant B's requests (A: 10x)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2,
                    help="fcfs, vtc, fcfs, vtc, ...: alternating, so that a change in the machine's "
                         "other load shows up as a difference between rounds, not between policies")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvserve-bench-tenants-"))
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({"keys": {"key-a": {"tenant": "A"}, "key-b": {"tenant": "B"}}}))
    results = [(p, run(p, args, keys, tmp / f"{p}{i}.json")) for i in range(args.rounds) for p in ("fcfs", "vtc")]
    lines = [f"Two tenants on stories260K-hf: A at {10 * args.rate_b:g} req/s ({10 * args.n_b} requests), "
             f"B at {args.rate_b:g} req/s ({args.n_b} requests), {args.input_len} prompt + "
             f"{args.output_len} output tokens each, --max-num-seqs {args.max_num_seqs}.", "",
             "| policy | B p50 TTFT ms | B p99 TTFT ms | A p99 TTFT ms | A share in window | B share in window |",
             "|---|---|---|---|---|---|"]
    for policy, res in results:
        a, b = res["tenants"]["key-a"], res["tenants"]["key-b"]
        lines.append(f"| {policy} | {b['p50_ttft_ms']:.0f} | {b['p99_ttft_ms']:.0f} | {a['p99_ttft_ms']:.0f} | "
                     f"{a['share_window']:.2f} | {b['share_window']:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
