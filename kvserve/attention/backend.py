"""The attention backend interface (vLLM's AttentionBackend / AttentionImpl, in one class): what
every layer calls, and what the model runner asks of a backend to size and allocate its cache."""
from __future__ import annotations

import copy

import torch

from kvserve.attention.metadata import AttentionMetadata
from kvserve.config.names import check_kv_cache_dtype


class AttentionBackend:
    """Writes the new K/V into the cache and attends. Shapes: q [T, H, D]; k, v [T, KV, D];
    returns [T, H, D]. The backend owns the layout of one layer's cache (`cache_shape`); with a
    quantized `kv_cache_dtype` each cache is (values, scales) (kv_quant.py).

    Per step: `prepare(meta)` once, before the first layer (what the backend derives from the
    step's metadata: masks, layouts), then `forward` per layer on decode rows, prefill rows or
    both (decode rows first). A subclass names itself (`name`, the --attention-backend value) and
    says where it cannot run (`unsupported`).

    A model's attention facts beyond its heads come from its ModelConfig in `for_model`: the
    scale (Gemma's query_pre_attn_scalar) and `softcap` (scores -> cap * tanh(scores / cap), Gemma 2);
    a model whose layers differ in sliding window attends through `for_layer(window)` copies
    (the step's masks are derived once per window: AttentionMetadata)."""

    name = ""
    per_layer = False          # a `for_layer` copy: its window's masks, not the step's prepared ones

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None = None, kv_cache_dtype: str = "auto"):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.softcap: float | None = None

    @classmethod
    def unsupported(cls, cfg, device: torch.device, dtype: torch.dtype, kv_cache_dtype: str) -> str | None:
        """Why this backend cannot run `cfg`'s heads (one rank's) on `device` in `dtype` with a
        `kv_cache_dtype` cache; None when it can."""
        return None

    @classmethod
    def for_model(cls, cfg, block_size: int, kv_cache_dtype: str = "auto") -> "AttentionBackend":
        """The backend for `cfg`'s heads (a ModelConfig, or one rank's slice of it)."""
        backend = cls(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size, cfg.sliding_window,
                      kv_cache_dtype)
        if getattr(cfg, "query_pre_attn_scalar", None):
            backend.scale = cfg.query_pre_attn_scalar ** -0.5
        backend.softcap = getattr(cfg, "attn_logit_softcapping", None) or None
        return backend

    def for_layer(self, sliding_window: int | None) -> "AttentionBackend":
        """This backend for a layer of its own sliding window (None: global attention)."""
        layer = copy.copy(self)
        layer.sliding_window, layer.per_layer = sliding_window, True
        return layer

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with what this backend needs derived once (every layer reads it)."""
        return meta

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        raise NotImplementedError

    def cache_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one layer's K and V pools (the same, unless a backend says otherwise)."""
        return self.cache_shape(num_blocks), self.cache_shape(num_blocks)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError
