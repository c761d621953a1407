"""Multi-head latent attention's cache against full K/V (issue 34's MLA aim): KV bytes a token of a
DeepSeek-V2-Lite-shaped model and the sequences that fit in a fixed pool, measured from the
engine's own pool sizing, before (per-head K and V) and after (one latent and one RoPE key part).

Two random checkpoints with DeepSeek-V2-Lite's attention shape -- 27 layers, 16 heads, kv_lora_rank
512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128 -- and a small hidden size and MLP
(what the cache holds does not depend on them):
- after: DeepseekV2ForCausalLM, cached as latents (kvserve/attention/mla.py);
- before: a LlamaForCausalLM of the same 27 layers and 16 KV heads of width 192, the cache an
  engine without MLA keeps for this model (keys nope + rope wide, values padded to the same width
  as vLLM's non-MLA path stores them; unpadded values would be 320 of 384 of it).
Each loads into kvserve with the same --kv-cache-memory; the figures are the engine's blocks,
tokens and bytes a token, and how many sequences of --seq-len fit at once. Then each decodes
--decode-batch sequences at --decode-context cached tokens (bf16, greedy, --decode-tokens new
tokens, the prefill's time taken out), the two alternating, medians of --repeats: what reading the
latents instead of full K/V does to a step (absorbed decode multiplies more per cached token).

    python benchmarks/bench_mla.py --out benchmarks/results/mla.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LITE = dict(num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=128, v_head_dim=128)
SMALL = dict(vocab_size=1024, hidden_size=256, intermediate_size=64, max_position_embeddings=8192,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def build(out: Path, mla: bool) -> Path:
    import transformers as tf

    torch.manual_seed(0)
    if mla:
        cfg = tf.DeepseekV2Config(**SMALL, **LITE, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1)
    else:
        cfg = tf.LlamaConfig(**SMALL, num_hidden_layers=LITE["num_hidden_layers"], num_attention_heads=16,
                             num_key_value_heads=16, head_dim=LITE["qk_nope_head_dim"] + LITE["qk_rope_head_dim"])
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    return out


def measure(model_dir: Path, budget: int, seq_len: int) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=budget, max_model_len=seq_len)
    llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0.0))
    runner = llm.engine.runner
    blocks, bs = llm.engine.kv.pool.num_blocks, runner.block_size
    pool_bytes = sum(t.numel() * t.element_size() for t in runner.kv_cache_tensors())   # (+ the null block)
    tokens = blocks * bs
    return dict(architecture=llm.engine.model.cfg.architecture, blocks=blocks, block_size=bs, tokens=tokens,
                pool_bytes=pool_bytes, bytes_per_token=pool_bytes / ((blocks + 1) * bs),
                sequences_of_seq_len=tokens // seq_len)


def decode_tok_s(llm, batch: int, context: int, new: int) -> float:
    """Decode tokens/s of `batch` sequences after a `context`-token prompt each, prefill taken out."""
    from kvserve import SamplingParams

    prompts = [{"prompt_token_ids": [1] + [(31 * b + 7 * j) % 1000 + 3 for j in range(context - 1)]}
               for b in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new + 1, temperature=0.0, ignore_eos=True))
    return batch * new / (time.perf_counter() - t0 - prefill)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="the pool's bytes (default 4 GiB)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--decode-batch", type=int, default=4)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvserve import LLM

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {kind: build(Path(tmp) / kind, kind == "mla") for kind in ("full", "mla")}
        rows = {kind: measure(d, args.kv_cache_memory, args.seq_len) for kind, d in dirs.items()}
        need = args.decode_batch * (args.decode_context + args.decode_tokens + 16) * rows["full"]["bytes_per_token"]
        engines = {kind: LLM(str(d), dtype="bfloat16", kv_cache_memory=int(need * 1.2) + (64 << 20),
                             max_model_len=args.decode_context + args.decode_tokens + 16, enable_prefix_caching=False)
                   for kind, d in dirs.items()}
        speeds = {kind: [] for kind in engines}
        for rep in range(args.repeats):
            for kind in (("full", "mla") if rep % 2 == 0 else ("mla", "full")):
                speeds[kind].append(decode_tok_s(engines[kind], args.decode_batch, args.decode_context,
                                                 args.decode_tokens))
                print(f"  repeat {rep} {kind:4} decode {speeds[kind][-1]:.1f} tok/s", flush=True)
    full, mla = rows["full"], rows["mla"]
    result = dict(capability=torch.backends.cpu.get_cpu_capability(), kv_cache_memory=args.kv_cache_memory,
                  seq_len=args.seq_len, full_kv=full, mla=mla,
                  bytes_per_token_ratio=full["bytes_per_token"] / mla["bytes_per_token"],
                  sequences_ratio=mla["sequences_of_seq_len"] / max(full["sequences_of_seq_len"], 1),
                  decode=dict(batch=args.decode_batch, context=args.decode_context, tokens=args.decode_tokens,
                              runs=speeds, full_tok_s=statistics.median(speeds["full"]),
                              mla_tok_s=statistics.median(speeds["mla"]), load_average=os.getloadavg()[0]))
    result["decode"]["mla_over_full"] = result["decode"]["mla_tok_s"] / result["decode"]["full_tok_s"]
    print(f"pool {args.kv_cache_memory / 2**30:.2f} GiB, bf16 cache, sequences of {args.seq_len} tokens "
          f"({result['capability']})")
    print(f"{'':28}{'bytes/token':>14}{'tokens':>12}{'sequences':>11}")
    for name, r in (("full K/V (16 heads x 192)", full), ("MLA latent (512 + 64)", mla)):
        print(f"{name:28}{r['bytes_per_token']:>14,.0f}{r['tokens']:>12,}{r['sequences_of_seq_len']:>11}")
    unpadded = LITE["num_hidden_layers"] * 16 * (128 + 64 + 128) * 2                  # bf16, values 128 wide
    result["unpadded_full_bytes_per_token"] = unpadded
    print(f"MLA holds {result['bytes_per_token_ratio']:.2f}x the tokens of full K/V "
          f"({unpadded / mla['bytes_per_token']:.2f}x of unpadded K/V, {unpadded:,} bytes a token)")
    d = result["decode"]
    print(f"decode, batch {d['batch']} at {d['context']} cached tokens, bf16: full K/V {d['full_tok_s']:.1f} tok/s, "
          f"MLA {d['mla_tok_s']:.1f} tok/s ({d['mla_over_full']:.2f}x), medians of {args.repeats}, load average "
          f"{d['load_average']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
