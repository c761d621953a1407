"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3 / Phi-4) over a flat, packed batch of tokens.

There is no batch dimension: `input_ids [T]` holds the scheduled tokens of every sequence, the
attention backend keeps sequences apart, and logits are computed only at `logits_indices`
(the last scheduled token of each sequence that samples this step).
"""
from __future__ import annotations

import logging

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.metadata import AttentionMetadata
from kvserve.model.config import ModelConfig
from kvserve.model.quant.cpu_paths import kernel_plan
from kvserve.model.fused_decode import FusedDecode
from kvserve.model.fusion import embedding_rows, embedding_weight, linear_weight
from kvserve.model.layers import add_rms_norm, apply_rope, gated_activation, rms_norm, rope_tables
from kvserve.config.names import parse_quantization
from kvserve.model.quant.formats import Int8Weight, QuantizedWeight, input_dtype, linear

logger = logging.getLogger(__name__)
EMBED = "model.embed_tokens.weight"


class LlamaLayer:
    """One decoder layer's weights, fused: qkv [(H + 2 KV) * D, hidden], gate_up [2I, hidden].
    `w` holds the small tensors in the model dtype; `lin(name, parts)` builds a linear weight
    (a tensor, or a QuantizedWeight) from the checkpoint's row blocks (names, or tensors).
    `build_mlp` and `mlp` are the feed-forward half: a subclass swaps them (moe_models.py)."""

    dense_mlp = True        # the fused decode step (fused_decode.py) runs only this MLP

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, lin, index: int = 0,
                 raw: dict | None = None):
        a = prefix + "self_attn."
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_norm = w[prefix + "post_attention_layernorm.weight"]
        self.qkv = lin(a + "qkv_proj", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"])
        self.qkv_bias = (torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
                         if cfg.attention_bias else None)
        self.o = lin(a + "o_proj", [a + "o_proj.weight"])
        self.q_norm = w.get(a + "q_norm.weight")
        self.k_norm = w.get(a + "k_norm.weight")
        self.build_mlp(w, prefix, cfg, lin, index, raw)

    def build_mlp(self, w: dict, prefix: str, cfg: ModelConfig, lin, index: int, raw: dict | None) -> None:
        """The MLP's weights (`index`: the layer's number in the whole model; `raw`: the
        checkpoint's tensors, HF names, as they arrived)."""
        m = prefix + "mlp."
        self.gate_up = lin(m + "gate_up_proj", [m + "gate_proj.weight", m + "up_proj.weight"])
        self.down = lin(m + "down_proj", [m + "down_proj.weight"])
        self.act = gated_activation(cfg.hidden_act)         # act(gate) * up: SwiGLU, GeGLU, ...

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        """The post-attention-norm stream [T, hidden] -> the MLP's output [T, hidden] (partial if tp).
        A float32 model's big steps: gate_up's bfloat16 GEMM output into the activation, whose
        float32 result is stored in the dtype down's GEMM takes (bfloat16, rounded once)."""
        gate_up = linear(h, self.gate_up, gemm_dtype=True)
        return linear(self.act(gate_up, h.dtype, input_dtype(self.down, h)), self.down).to(h.dtype)

    def linears(self) -> list:
        """Every linear weight of the layer (a tensor or a QuantizedWeight)."""
        return [*self.attention_linears(), self.gate_up, self.down]

    def attention_linears(self) -> list:
        return [self.qkv, self.o]


class LlamaModel:
    """`quantization` ("int8", "int4" or None) quantizes every linear weight and an untied
    lm_head at load (kvserve/model/quant/formats.py); the embedding and norms stay in `dtype`. With None,
    weights that arrive quantized (a GGUF file, quant/gguf_types.py) keep their format, the embedding
    too (it is then also the tied lm_head); "dequant" turns them into `dtype`.
    `quantize_activations`: int8 weights run W8A8 on steps of more than 8 rows (quant/formats.py).
    `stage` (a model/stages.py Stage): this is one pipeline stage, `cfg` and `weights` its layers'
    (the embedding only on the first stage, the final norm and LM head only on the last)."""

    supports_pipeline = True        # embed_tokens / run_layers / final_hidden / logits, apart
    layer_class = LlamaLayer        # a family's layer (model/gemma.py, moe_models.py) reads more
    # checkpoint tensors `lin` reads itself (not copied into the model dtype first): linear weights
    own_suffixes = ("proj.weight",)

    def __init__(self, cfg: ModelConfig, weights: dict, attn: AttentionBackend,
                 device: torch.device, dtype: torch.dtype, quantization: str | None = None,
                 quantization_group_size: int | None = None, tp=None, quantize_activations: bool = False,
                 stage=None):
        self.cfg, self.attn, self.device, self.dtype = cfg, attn, device, dtype
        self.tp = tp            # a dist.tensor_parallel.TPGroup: cfg and weights are this rank's slice
        self.stage = stage
        last = stage is None or stage.is_last
        quantization, quantization_group_size = parse_quantization(quantization, quantization_group_size)
        own = {k for k in weights if k.endswith(self.own_suffixes) or k in ("lm_head.weight", EMBED)}
        w = {k: v.to(device=device, dtype=dtype) for k, v in weights.items() if k not in own}

        def lin(name: str, parts: list):
            return linear_weight([weights[p] if isinstance(p, str) else p for p in parts], name,
                                 quantization, quantization_group_size, device, dtype)

        self.embed = (embedding_weight(weights[EMBED], quantization, device, dtype)   # [V, hidden]
                      if EMBED in weights else None)                  # (a later pipeline stage: none)
        self.lm_head = None if not last else (self.embed if cfg.tie_word_embeddings
                                              else lin("lm_head", ["lm_head.weight"]))
        self.norm = w["model.norm.weight"] if last else None
        first = stage.first_layer if stage is not None else 0
        self.layers = [self.layer_class(w, f"model.layers.{i}.", cfg, lin, first + i, weights)
                       for i in range(cfg.num_layers)]
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim          # Phi-4-mini: a part of each head
        cos, sin = rope_tables(self.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.rope_cos = cos.to(device)                                       # [P, rotary_dim] float32
        self.rope_sin = sin.to(device)
        self.act = gated_activation(cfg.hidden_act)
        if (cfg.rope_scaling or {}).get("rope_type") == "longrope" and (stage is None or stage.is_first):
            orig = cfg.rope_scaling["original_max_position_embeddings"]
            logger.info("LongRoPE: positions below %d rotate with short_factor, from %d on with "
                        "long_factor (transformers rotates all of a prompt longer than %d with "
                        "long_factor)", orig, orig, orig)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        if quantize_activations and self._use_w8a8() == 0:
            why = (f"on CPU capability {kernel_plan().capability} quantized weights are held dequantized "
                   "(no quantized path wins there)" if device.type == "cpu" and kernel_plan().float_resident
                   else "this model has no int8 linear weights")
            raise ValueError(f"quantize_activations runs int8 linear weights as W8A8, and {why}: drop "
                             "quantize_activations, or load the model with quantization='int8'.")
        self.fused = FusedDecode.build(self)      # None: every step runs layer by layer

    def unfused(self) -> str | None:
        """What of this model the fused decode step (model/fused_decode.py) lacks; None: nothing."""
        if self.rotary_dim != self.cfg.head_dim:
            return f"RoPE on {self.rotary_dim} of {self.cfg.head_dim} head dims"
        if self.act is not gated_activation("silu"):
            return f"MLP activation {self.cfg.hidden_act}"
        return None

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k heads [T, heads, D]: all D dims, or the first rotary_dim."""
        if self.rotary_dim == qk.shape[-1]:
            return apply_rope(qk, cos, sin)
        r = self.rotary_dim
        return torch.cat([apply_rope(qk[..., :r], cos, sin), qk[..., r:]], dim=-1)

    def _use_w8a8(self) -> int:
        """int8 linear weights run W8A8 on big steps (formats.Int8Weight.use_w8a8); returns how many."""
        weights = {id(w): w for layer in self.layers for w in layer.linears()}
        if self.lm_head is not None:
            weights[id(self.lm_head)] = self.lm_head
        int8 = [w for w in weights.values() if isinstance(w, Int8Weight)]
        for w in int8:
            w.use_w8a8()
        return len(int8)

    def weight_bytes(self) -> int:
        """Resident bytes of the weights; a quantized weight counts its packed bytes and scales."""
        seen, total = set(), 0
        tensors = [t for t in (self.embed, self.lm_head, self.norm) if t is not None]
        for layer in self.layers:
            tensors += [t for v in vars(layer).values() for t in (v if isinstance(v, list) else [v])
                        if isinstance(t, (torch.Tensor, QuantizedWeight))]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.nbytes
        return total

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> logits [S, V] float32 at `logits_indices` [S]."""
        x = self.hidden_states(input_ids, positions, meta, kv_caches, logits_indices)   # [S, hidden]
        return self.logits(x)

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list, indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> the final hidden states (after the final norm) [S, hidden]
        at `indices` [S]: what the lm_head reads, and what pooling reads (kvserve/pooling/)."""
        x = self.run_layers(self.embed_tokens(input_ids), positions, meta, kv_caches)
        return self.final_hidden(x, indices)

    # -- the pass in pieces (a pipeline stage runs those it holds: kvserve/distributed/pipeline.py)
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the residual stream's start [T, hidden]."""
        if self.tp is None:
            return embedding_rows(self.embed, input_ids)
        return self.tp.embed(self.embed, input_ids)

    def final_hidden(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """The residual stream [T, hidden] -> the final norm's output at `indices` [S, hidden]."""
        return rms_norm(x[indices], self.norm, self.cfg.rms_norm_eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [S, hidden] -> logits [S, V] float32."""
        logits = linear(h, self.lm_head)                               # [S, V] ([S, V'] if tp)
        return (logits if self.tp is None else self.tp.gather_logits(logits)).float()

    @torch.inference_mode()
    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list) -> torch.Tensor:
        """The residual stream [T, hidden] through every decoder layer this model holds."""
        cfg = self.cfg
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        T = x.shape[0]
        tp = self.tp
        if self.fused is not None and self.fused.takes(T, meta.num_decode_tokens):
            x = self.fused.run(x, positions, meta, kv_caches)
            for i in range(len(self.layers) if meta.kv_written is not None else 0):
                meta.kv_written(i)
            return x
        cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)   # [T, 1, D]
        sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
        h = None            # the next layer's normed input, when the last add computed it
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if h is None:
                h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias)                # [T, (H + 2KV) * D]
            qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk, v = qk.view(T, H + KV, D), v.view(T, KV, D)
            if layer.q_norm is not None and cfg.qk_norm_full:   # OLMoE: over all heads' width
                qk = torch.cat([rms_norm(qk[:, :H].reshape(T, H * D), layer.q_norm, cfg.rms_norm_eps),
                                rms_norm(qk[:, H:].reshape(T, KV * D), layer.k_norm, cfg.rms_norm_eps)],
                               dim=1).view(T, H + KV, D)
            elif layer.q_norm is not None:   # Qwen3: per-head RMSNorm of q and k before RoPE
                qk = torch.cat([rms_norm(qk[:, :H], layer.q_norm, cfg.rms_norm_eps),
                                rms_norm(qk[:, H:], layer.k_norm, cfg.rms_norm_eps)], dim=1)
            if cfg.clip_qkv is not None:     # OLMoE: after the norms, before RoPE
                qk, v = qk.clamp(-cfg.clip_qkv, cfg.clip_qkv), v.clamp(-cfg.clip_qkv, cfg.clip_qkv)
            qk = self.rope(qk, cos, sin)                              # q and k heads at once
            q, k = qk[:, :H], qk[:, H:]
            o = self.attn.forward(q, k, v, k_cache, v_cache, meta)    # [T, H, D]
            if meta.kv_written is not None:                           # this layer's K/V are in the pool
                meta.kv_written(i)
            attn_out = linear(o.reshape(T, H * D), layer.o)           # [T, hidden] (partial if tp)
            x, h = add_rms_norm(x, attn_out if tp is None else tp.all_reduce(attn_out), layer.post_norm,
                                cfg.rms_norm_eps)
            mlp_out = layer.mlp(h)
            mlp_out = mlp_out if tp is None else tp.all_reduce(mlp_out)
            if i + 1 < len(self.layers):        # the add and the next layer's first norm in one pass
                x, h = add_rms_norm(x, mlp_out, self.layers[i + 1].input_norm, cfg.rms_norm_eps)
            else:
                x = x + mlp_out
        return x
