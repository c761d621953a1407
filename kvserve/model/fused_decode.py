"""The fused decode step (seed 000, "a decode step reads every weight byte"): every decoder layer
of a pure-decode step in one call of kvserve's C++ kernels (`torch.ops.kvserve.decode_layers`,
kvserve/kernels), instead of ~220 eager ATen calls a layer.

Chosen once at load: the model must be float32 or bfloat16 on the CPU, without tensor
parallelism, with a KV cache in the model's dtype or int8, head dims and GQA ratios the attention kernel holds,
and linear weights the kernels read (float32 or bfloat16 tensors, int4, int8, GGUF Q8_0 and Q6_K), dense MLPs or mixtures of experts
(kvserve/model/moe_models.py: softmax top-k routing, a shared expert; the router and its
scale go to the kernel, which reads only the chosen experts), per-head q/k norms and no clip_qkv. Anything else runs the
layer-by-layer torch path, with one log line naming why. A step with prefill chunks always takes
the torch path (its decode rows still reach the fused attention and GEMV ops there).
"""
from __future__ import annotations

import logging

import torch

from kvserve import kernels
from kvserve.model.quant.formats import Int4Weight, Int8Weight
from kvserve.model.quant.gguf_blocks import Int8BlockWeight

logger = logging.getLogger(__name__)
DENSE, INT4, INT8, Q8_0 = 0, 1, 2, 3
MAX_ROWS = 64        # decode rows the fused step takes (its scratch grows with them)
EMPTY = torch.empty(0)


def linear_spec(w) -> tuple | None:
    """(format, group, a, b, c) of a linear weight as the kernels read it, or None."""
    if isinstance(w, torch.Tensor):
        return (DENSE, 0, w, EMPTY, EMPTY) if w.dtype in (torch.float32, torch.bfloat16) else None
    if isinstance(w, Int4Weight):
        return INT4, w.group_size, w.nibbles, w.scales, EMPTY if w.high is None else w.high
    if isinstance(w, Int8Weight) and w.shape[1] % 32 == 0:
        return INT8, 0, w.q, w.scale, EMPTY
    if isinstance(w, Int8BlockWeight) and w.q is not None:
        return Q8_0, w.block, w.q, w.d, EMPTY
    return None


def _layer_pack(layer) -> tuple[list, list[int]] | None:
    """One layer's tensors and spec ints as csrc/layers.cpp reads them (its header comment); None
    when a weight is in a format the kernels do not read.
    A mixture-of-experts layer (moe_models.MoeLayer) adds its router, routing scale, experts and
    shared expert after the 17 tensors, its gate_up / down slots left empty."""
    moe = not layer.dense_mlp
    lins = [linear_spec(w) for w in (layer.qkv, layer.o)]
    lins += [(DENSE, 0, EMPTY, EMPTY, EMPTY)] * 2 if moe else [linear_spec(layer.gate_up), linear_spec(layer.down)]
    tensors = [_f32(layer.input_norm), _f32(layer.post_norm),
               *[EMPTY if t is None else _f32(t) for t in (layer.qkv_bias, layer.q_norm, layer.k_norm)]]
    spec: list[int] = []
    shared = 0
    if moe:
        experts = [w for e in range(len(layer.experts_gate_up)) for w in (layer.experts_gate_up[e], layer.experts_down[e])]
        if layer.shared_gate_up is not None:
            shared = 2 if layer.shared_gate is not None else 1
            experts += [layer.shared_gate_up, layer.shared_down]
        extra = [linear_spec(w) for w in experts]
        if any(x is None for x in extra):
            return None
    if any(x is None for x in lins):
        return None
    for fmt, group, a, b, c in lins:
        tensors += [a, b, c]
        spec += [fmt, group]
    spec += [len(layer.experts_gate_up), layer.top_k, int(layer.renormalize), shared] if moe else [0, 0, 0, 0]
    if moe:
        tensors += [_f32(layer.router), torch.tensor([float(layer.route_scale)])]
        for fmt, group, a, b, c in extra:
            tensors += [a, b, c]
            spec += [fmt, group]
        if shared == 2:
            tensors.append(_f32(layer.shared_gate))
    return tensors, spec


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A norm, bias or router as the kernels read it: float32 (a copy only in a bfloat16 model)."""
    return t.float().contiguous()


class FusedDecode:
    """The flat weight list and spec `decode_layers` reads, built once from a LlamaModel."""

    def __init__(self, model, weights: list[torch.Tensor], spec: list[int]):
        self.model, self.weights, self.spec = model, weights, spec
        # Every format takes batches of up to MAX_ROWS: kvserve's kernels run int4 and Q8_0 at
        # any row count (int16 dot products to 3 rows, float blocks to 8, dequantized tiles past
        # that), and one call a step saves the layer-by-layer path's Python and thread forks.
        # SmolLM2-135M Q4_1 decode, against the fused step limited to 3 rows with torch's int4
        # kernel past them: 1.17x at batch 4, 1.32x at 8, 1.37x at 16, 1.35x at 64
        # (benchmarks/results/batched_decode.json). A mixture of experts splits a batch into a few
        # rows per expert, and its torch path loops over experts in Python: on a Q8_0
        # Mixtral-shaped file the fused step measured 178 against 115 tokens/s at 8 rows and 280
        # against 180 at 32 (docs/performance/quantization.md).
        self.max_rows = MAX_ROWS

    @classmethod
    def build(cls, model) -> "FusedDecode | None":
        why = cls._why_not(model)
        if why is None:
            weights, spec = [], []
            for layer in model.layers:
                packed = _layer_pack(layer)
                if packed is None:
                    why = "a linear weight format the kernels do not read"
                    break
                weights += packed[0]
                spec += packed[1]
        if why is not None:
            logger.info("fused decode step off (%s): decode steps run layer by layer in torch", why)
            return None
        fused = cls(model, weights, spec)
        logger.info("fused decode step on: pure-decode steps of up to %d rows run every layer in one "
                    "kernel call (%s)", fused.max_rows, kernels.isa())
        return fused

    @staticmethod
    def _why_not(model) -> str | None:
        cfg, attn = model.cfg, model.attn
        lacking = model.unfused()                      # the model's own features (RoPE part, MLP, ...)
        if lacking is not None:
            return lacking
        if model.device.type != "cpu" or not kernels.available(model.device):
            return "no kvserve kernels here"
        if model.dtype not in (torch.float32, torch.bfloat16):
            return f"model dtype {model.dtype}, the fused step runs float32 and bfloat16 models"
        if model.tp is not None:
            return "tensor parallelism"
        if attn.kv_cache_dtype not in ("auto", "bfloat16", "int8"):
            return f"kv_cache_dtype {attn.kv_cache_dtype}"
        if attn.name != "cpu_fused":
            return f"attention backend {attn.name or type(attn).__name__} (the fused step is cpu_fused's)"
        if cfg.num_heads % cfg.num_kv_heads or cfg.num_heads // cfg.num_kv_heads > 16 or cfg.head_dim > 256:
            return f"{cfg.num_heads} query heads on {cfg.num_kv_heads} KV heads of dim {cfg.head_dim}"
        if cfg.head_dim % 2:
            return f"odd head dim {cfg.head_dim}"
        moe = [layer for layer in model.layers if not layer.dense_mlp]
        if any(layer.route_groups is not None or layer.route_scoring != "softmax" for layer in moe):
            return "grouped or sigmoid expert routing (the kernels route by softmax over all experts)"
        if cfg.qk_norm_full or cfg.clip_qkv is not None:
            return "q/k norms over the full width or clip_qkv (the kernels norm each head, unclipped)"
        return None

    def takes(self, num_tokens: int, num_decode_tokens: int) -> bool:
        """A pure-decode step of at most `max_rows` rows."""
        return num_tokens == num_decode_tokens and 0 < num_tokens <= self.max_rows

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor:
        """x [B, hidden] (the embeddings) -> the residual stream after the last layer. The step
        runs in float32 whatever the model's dtype: a bfloat16 model's weights and KV cache stay
        bfloat16 (its GEMMs round their input to bfloat16, its K/V are rounded as they are
        written), the residual stream, norms, RoPE and attention are float32. An int8 KV cache
        is written and read as attention/kv_quant.py stores it (a scale per token and head)."""
        m, cfg = self.model, self.model.cfg
        dtype = x.dtype
        x = x.float()
        ks, vs = [k for k, _ in kv_caches], [v for _, v in kv_caches]
        k_scales = v_scales = []
        if isinstance(ks[0], tuple):                   # int8: (values, scales) per pool
            k_scales, v_scales = [s for _, s in ks], [s for _, s in vs]
            ks, vs = [q for q, _ in ks], [q for q, _ in vs]
        torch.ops.kvserve.decode_layers(
            x, self.weights, self.spec, m.rope_cos, m.rope_sin, positions,
            ks, vs, k_scales, v_scales, meta.decode_block_tables,
            meta.decode_context_lens, meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads,
            cfg.rms_norm_eps, m.attn.scale, m.attn.sliding_window or 0)
        return x.to(dtype)
