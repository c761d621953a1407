"""Shared pieces of the benchmarks: the seeded ~100M-parameter random Llama of issue 2."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

SHARED = Path(__file__).resolve().parents[2] / "shared"
BENCH_MODEL_CONFIG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                          num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                          max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                          bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def bench_model_dir(root: str | None = None) -> Path:
    """Build (once) and return the benchmark model: random weights, seed 0, float32 safetensors."""
    out = Path(root or os.environ.get("KVSERVE_BENCH_MODEL", "/tmp/kvserve-bench-llama-100m"))
    if (out / "model.safetensors").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BENCH_MODEL_CONFIG))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # A tokenizer makes the directory a complete model for `kvserve serve`; ids above 511
    # decode to nothing, which the benchmarks never need.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHARED / "models" / "stories260K-hf" / name, out / name)
    return out
