"""EngineConfig: every engine knob in one place, with vLLM's names, and its CLI flags."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"                 # float32 | bfloat16 | float16 ("auto": the model's own)
    device: str = "auto"                   # cpu | cuda | auto
    block_size: int = 16
    max_num_batched_tokens: int = 2048     # the token budget of one step
    max_num_seqs: int = 256
    kv_cache_memory: int | None = None     # bytes for the KV pool (default: 1 GiB, or 90% of free GPU memory)
    num_kv_blocks: int | None = None       # overrides kv_cache_memory
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    seed: int | None = 0
    watermark: float = 0.01                # fraction of blocks kept free when admitting a request

    def __post_init__(self):
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}.")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}.")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES.get(self.dtype, torch.float32)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", required=True, help="model directory (HF layout or llama2.c)")
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--max-num-seqs", type=int, default=256)
        parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool")
        parser.add_argument("--num-kv-blocks", type=int, default=None)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--seed", type=int, default=0)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
