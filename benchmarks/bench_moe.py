"""A mixture-of-experts model's decode against its dense equivalent in active parameters (issue 34's
aim: active parameters decide the step, not total ones), on GGUF files kvserve and llama.cpp both
read.

Two random-weight checkpoints of the same attention and vocabulary, written as llama.cpp's converter
writes them (the tests' writers: experts stacked as `ffn_*_exps`, q/k permuted) in one GGUF type:
- MoE: Mixtral-shaped, 8 experts of width I, top 2 (about 0.64B parameters, 0.18B active);
- dense: a Llama whose MLP has width 2 I, so that one token multiplies as many weights.
kvserve decodes each (128-token prompt, 128 new tokens, greedy; the prefill's time taken out, as
benchmarks/bench_llamacpp.py does, in a fresh subprocess per measurement), the two alternating; the
figure is the MoE's step time over the dense model's (median of the repeats). llama.cpp's figures on
the same files: `bench_llamacpp.py --gguf FILE --no-perplexity`.

    python benchmarks/bench_moe.py --out benchmarks/results/moe.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

SHAPE = dict(vocab_size=512, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
             num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1,
             eos_token_id=2, tie_word_embeddings=False)


def build(out: Path, moe: bool, inter: int, experts: int) -> Path:
    """A random checkpoint (seed 0) saved with save_pretrained, with the stories tokenizer."""
    import transformers as tf

    if (out / "model.safetensors").exists():
        return out
    torch.manual_seed(0)
    cfg = (tf.MixtralConfig(**SHAPE, intermediate_size=inter, num_local_experts=experts, num_experts_per_tok=2)
           if moe else tf.LlamaConfig(**SHAPE, intermediate_size=2 * inter))
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT.parent / "shared" / "models" / "stories260K-hf" / name, out / name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/kvserve-bench-moe")
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("--inter", type=int, default=2048, help="each expert's width (the dense MLP: twice it)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from bench_llamacpp import KVSERVE_CHILD, N, THREADS, python_child
    from tests.model.gguf_files import write_hf_as_gguf
    from tests.model.test_gguf_moe import write_moe_gguf

    root = Path(args.dir)
    files = {}
    for kind in ("moe", "dense"):
        hf = build(root / f"{kind}-hf", kind == "moe", args.inter, args.experts)
        path = root / f"{kind}-{args.qtype}.gguf"
        if not path.exists():
            (write_moe_gguf if kind == "moe" else write_hf_as_gguf)(hf, path, args.qtype)
        files[kind] = str(path)
        print(f"{kind}: {path} ({path.stat().st_size / 1e6:.0f} MB)", flush=True)
    runs = {k: [] for k in files}
    for rep in range(args.repeats):
        for kind in (files if rep % 2 == 0 else list(reversed(files))):
            r = python_child(KVSERVE_CHILD.format(threads=THREADS, path=files[kind], n=N, rep=rep,
                                                  batches=[8, 32], kwargs={}))
            runs[kind].append(r)
            print(f"  repeat {rep} {kind:5s} decode {r['decode_tok_s']:.1f} tok/s  b8 {r['decode_b8_tok_s']:.1f}  "
                  f"b32 {r['decode_b32_tok_s']:.1f}  weights {r['weight_bytes'] / 1e6:.0f} MB", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode_tok_s", "decode_b8_tok_s", "decode_b32_tok_s")}
           for k, v in runs.items()}
    ratio = {m: med["dense"][m] / med["moe"][m] for m in med["moe"]}      # MoE step time / dense step time
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"\n{args.qtype}, {THREADS} threads, {cap}, load average {os.getloadavg()[0]:.2f}; medians of {args.repeats}")
    for m in med["moe"]:
        print(f"  {m:18s} MoE {med['moe'][m]:8.1f}  dense {med['dense'][m]:8.1f}  MoE step / dense step {ratio[m]:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"files": files, "qtype": args.qtype, "capability": cap,
                                              "medians": med, "moe_step_over_dense": ratio, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
