"""A model split across tensor-parallel ranks, Megatron-style (kvserve/distributed/ runs the ranks).

Each of N ranks holds a slice of every weight and runs its slice of the same forward pass:
- attention heads split: rank r owns query heads [r H/N, (r+1) H/N) and the KV heads they use
  (KV/N of them; where N exceeds KV, each rank keeps a copy of its one KV head, as vLLM does),
  so its KV pool holds only its own heads and KV memory per rank divides by N;
- q/k/v and gate/up are column-parallel (rows of the weight split), o and down row-parallel
  (columns split): each rank's o and down give partial sums, added by one all-reduce each;
- a mixture-of-experts model's experts stay whole (`--enable-expert-parallel`): rank r holds
  experts [r E/N, (r+1) E/N) and computes them for the tokens routed there (the router is
  replicated), so its MLP output is a partial sum the same all-reduce adds; Qwen2-MoE's shared
  expert splits like a dense MLP;
- the embedding and the LM head are vocabulary-parallel: rank r owns rows [r V', (r+1) V') with
  V' = ceil(V / N) (the last shard padded with zero rows); an embedding lookup is a masked local
  lookup plus an all-reduce, and the logits are all-gathered along the vocabulary.
Collectives go through `torch.distributed` (gloo on CPU, NCCL on CUDA); `TPGroup` is the only
place that calls them. Norm weights, RoPE and Qwen3's q/k norms (per head dimension) are
replicated. Weights a GGUF file stores quantized are dequantized before slicing (and quantized
again per shard when `quantization` asks for int8 / int4).
"""
from __future__ import annotations

import dataclasses
import math
import re

import torch
import torch.distributed as dist

from kvserve.model.config import ModelConfig
from kvserve.model.fusion import _float

_EXPERT = re.compile(r"\.experts\.(\d+)\.")                      # a per-expert tensor's expert
_FUSED = ("experts.gate_up_proj", "experts.down_proj")            # [E, ...] (model/moe.py's FUSED)


class TPGroup:
    """Rank `rank` of `size` in the default process group: the model's collectives."""

    def __init__(self, rank: int, size: int, vocab_size: int):
        self.rank, self.size, self.vocab_size = rank, size, vocab_size
        self.vocab_shard = math.ceil(vocab_size / size)
        self.vocab_start = rank * self.vocab_shard

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def embed(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of the vocabulary-parallel table [V', hidden] -> [T, hidden]."""
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < table.shape[0])
        rows = table[local.clamp(0, table.shape[0] - 1)]
        rows.masked_fill_(~mine.unsqueeze(1), 0)
        return self.all_reduce(rows)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[S, V'] of this rank's vocabulary -> [S, V] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :self.vocab_size]


def check_tp_size(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}.")
    if cfg.kv_lora_rank and size > 1:
        raise ValueError(f"tensor_parallel_size={size} is not built for multi-head latent attention "
                         f"({cfg.architecture}): every rank would need the whole latent cache; use 1.")
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {cfg.num_heads} "
                         "attention heads: choose a divisor.")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide "
                         "the other (KV heads are split, or replicated when there are fewer than ranks).")
    if cfg.num_experts and size > 1 and not expert_parallel:
        raise ValueError(f"tensor_parallel_size={size} splits a mixture-of-experts model ({cfg.architecture}) "
                         "by experts: give --enable-expert-parallel (enable_expert_parallel=True).")
    if cfg.num_experts and cfg.num_experts % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {cfg.num_experts} experts "
                         "(expert parallelism gives each rank as many whole experts).")
    if cfg.qk_norm_full and size > 1:
        raise ValueError(f"tensor_parallel_size={size} is not built for {cfg.architecture}: its q/k norms run "
                         "over every head's width at once, which a rank holding some heads cannot; use 1.")
    for name in ("intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name) and getattr(cfg, name) % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {name} {getattr(cfg, name)}.")


def check_expert_parallel(cfg: ModelConfig, expert_parallel: bool) -> None:
    if expert_parallel and not cfg.num_experts:
        raise ValueError(f"enable_expert_parallel splits a mixture-of-experts model's experts; "
                         f"{cfg.architecture} has none.")


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The experts rank `rank` of `size` holds under expert parallelism (contiguous, E / size)."""
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def shard_config(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """What one rank's slice of the model looks like (heads and dense MLP widths divided; an MoE
    model's experts stay whole, E / size of them on each rank: `expert_range`)."""
    check_tp_size(cfg, size, expert_parallel)
    shared = cfg.shared_expert_intermediate_size
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size,
                               num_kv_heads=max(cfg.num_kv_heads // size, 1),
                               intermediate_size=cfg.intermediate_size // size,
                               shared_expert_intermediate_size=shared // size if shared else shared)


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start:start + n].clone()


def shard_weights(weights: dict, cfg: ModelConfig, rank: int, size: int) -> dict:
    """Rank `rank`'s slice of a checkpoint's weights (HF names), as float tensors."""
    D, H, KV = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    h_per, kv_per = H // size, max(KV // size, 1)
    kv_first = rank * h_per // (H // KV)          # the first KV head this rank's queries use
    inter = cfg.intermediate_size // size
    shared = (cfg.shared_expert_intermediate_size or 0) // size
    vshard = math.ceil(cfg.vocab_size / size)
    mine = expert_range(cfg.num_experts, rank, size) if cfg.num_experts else range(0)
    out = {}
    for name, w in weights.items():
        expert = _EXPERT.search(name)
        if expert is not None:                                        # whole experts, this rank's only
            if int(expert.group(1)) in mine:
                out[name] = w
        elif name.endswith(_FUSED[0]):                                # [E, 2I, hidden]: per expert,
            I = w.shape[1] // 2                                       # this rank's only
            base = name[:-len(_FUSED[0])] + "experts."
            for e in mine:
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = w[e, :I].clone(), w[e, I:].clone()
        elif name.endswith(_FUSED[1]):                                # [E, hidden, I]
            base = name[:-len(_FUSED[1])] + "experts."
            for e in mine:
                out[f"{base}{e}.down_proj.weight"] = w[e].clone()
        elif ".shared_expert." in name and name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _rows(_float(w), rank * shared, shared)
        elif ".shared_expert." in name and name.endswith("down_proj.weight"):
            out[name] = _float(w)[:, rank * shared:(rank + 1) * shared].contiguous()
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = _rows(_float(w), rank * h_per * D, h_per * D)
        elif name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
            out[name] = _rows(_float(w), kv_first * D, kv_per * D)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _rows(_float(w), rank * inter, inter)
        elif name.endswith("o_proj.weight"):
            out[name] = _float(w)[:, rank * h_per * D:(rank + 1) * h_per * D].contiguous()
        elif name.endswith("down_proj.weight"):
            out[name] = _float(w)[:, rank * inter:(rank + 1) * inter].contiguous()
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            table = _rows(_float(w), rank * vshard, vshard)
            if table.shape[0] < vshard:                               # the last shard: pad
                table = torch.cat([table, table.new_zeros(vshard - table.shape[0], table.shape[1])])
            out[name] = table
        else:
            out[name] = w                                             # norms: replicated
    return out
