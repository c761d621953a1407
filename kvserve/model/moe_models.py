"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): LlamaModel's attention and
layer loop, each MoE layer's MLP swapped for the expert block of kvserve/model/moe.py.

Per family (the registry's defaults and config.json): Mixtral always renormalises its top-k
router weights; Qwen2-MoE has q/k/v biases and adds a sigmoid-gated shared expert; Qwen3-MoE
norms q and k per head; OLMoE norms them over all heads' width, and may clip q, k, v. Qwen's
`mlp_only_layers` / `decoder_sparse_step` leave some layers a dense MLP (ModelConfig.is_moe_layer).

A checkpoint stores the experts per expert (`experts.{e}.gate_proj.weight`, Mixtral's
`experts.{e}.w1.weight`; what transformers' save_pretrained writes) or fused
(`experts.gate_up_proj` [E, 2I, hidden], `experts.down_proj` [E, hidden, I]); both load.
`moe.check_expert_tensors` has refused a checkpoint whose experts do not match its config before
the model is built (loaders/checkpoint.py). Each expert is one fused gate/up and one down linear
weight, built like a dense MLP's, so `quantization` (int8 / int4) quantizes every expert; the
router and the shared expert's gate stay in the model dtype. The fused CPU decode step
(fused_decode.py, csrc/layers.cpp) runs these layers too, routing in the kernel; tensor parallelism splits the
model by experts (`--enable-expert-parallel`, model/sharding.py): a rank builds its own experts,
the others' entries are None, and its MLP output is a partial sum the all-reduce completes.
"""
from __future__ import annotations

import torch

from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaLayer, LlamaModel
from kvserve.model.moe import (expert_layout, experts_forward, held_experts, route, shared_expert_forward,
                               shared_expert_prefix)


class MoeLayer(LlamaLayer):
    """A decoder layer whose MLP is a mixture of experts (or dense, where the config says so).
    experts_gate_up / experts_down: per-expert linear weights [2I, hidden] / [hidden, I]."""

    def build_mlp(self, w: dict, prefix: str, cfg: ModelConfig, lin, index: int, raw: dict | None) -> None:
        self.dense_mlp = not cfg.is_moe_layer(index)
        if self.dense_mlp:
            self.experts_gate_up = self.experts_down = self.shared_gate_up = None
            super().build_mlp(w, prefix, cfg, lin, index, raw)
            return
        shapes = {k: tuple(v.shape) for k, v in raw.items() if k.startswith(prefix)}
        mlp, kind, n = expert_layout(shapes, prefix)
        m = prefix + mlp
        self.router = w[m + "gate.weight"]                             # [E, hidden]
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.route_scale, self.route_groups = cfg.routed_scaling_factor, cfg.topk_groups   # DeepSeek
        self.route_scoring = cfg.router_scoring
        self.route_bias = w.get(m + "gate.e_score_correction_bias")                         # V3: [E]
        if kind == "fused":
            gate_up, down = raw[m + "experts.gate_up_proj"], raw[m + "experts.down_proj"]
            self.experts_gate_up = [lin(f"{m}experts.{e}.gate_up_proj", [gate_up[e]]) for e in range(n)]
            self.experts_down = [lin(f"{m}experts.{e}.down_proj", [down[e]]) for e in range(n)]
        else:                 # (expert parallelism: this rank's experts only, the others None)
            held = held_experts(shapes, m)
            gate, up, down = (("w1", "w3", "w2") if any(f"{m}experts.{e}.w1.weight" in shapes for e in held)
                              else ("gate_proj", "up_proj", "down_proj"))           # Mixtral's, or HF's
            experts = [f"{m}experts.{e}." if e in held else None for e in range(cfg.num_experts)]
            self.experts_gate_up = [p and lin(p + "gate_up_proj", [f"{p}{gate}.weight", f"{p}{up}.weight"])
                                    for p in experts]
            self.experts_down = [p and lin(p + "down_proj", [f"{p}{down}.weight"]) for p in experts]
        s = m + shared_expert_prefix(cfg)
        self.shared_gate_up = self.shared_down = self.shared_gate = None
        if s + "gate_proj.weight" in shapes:                          # Qwen2-MoE, DeepSeek-V2
            self.shared_gate_up = lin(s + "gate_up_proj", [s + "gate_proj.weight", s + "up_proj.weight"])
            self.shared_down = lin(s + "down_proj", [s + "down_proj.weight"])
            self.shared_gate = w.get(m + "shared_expert_gate.weight")  # [1, hidden]

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.dense_mlp:
            return super().mlp(h)
        weights, ids = route(h, self.router, self.top_k, self.renormalize, self.route_scale,
                             self.route_groups, self.route_scoring, self.route_bias)   # [T, k] each
        out = experts_forward(h, weights, ids, self.experts_gate_up, self.experts_down)
        if self.shared_gate_up is not None:
            out = out + shared_expert_forward(h, self.shared_gate_up, self.shared_down, self.shared_gate)
        return out

    def linears(self) -> list:
        if self.dense_mlp:
            return super().linears()
        shared = [self.shared_gate_up, self.shared_down] if self.shared_gate_up is not None else []
        experts = [w for w in (*self.experts_gate_up, *self.experts_down) if w is not None]
        return [*self.attention_linears(), *experts, *shared]


class MoeModel(LlamaModel):
    """LlamaModel with MoeLayers (the registry's MixtralForCausalLM, Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM, OlmoeForCausalLM)."""

    layer_class = MoeLayer
    # expert tensors too are read by `lin` straight from the checkpoint
    own_suffixes = ("proj.weight", "w1.weight", "w2.weight", "w3.weight", "experts.gate_up_proj",
                    "experts.down_proj")

