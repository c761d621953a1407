"""ModelConfig: the architecture facts the forward pass needs, read from an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.registry import ARCHITECTURES, architecture, find_architecture

@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # Qwen2: biases on q, k, v
    qk_norm: bool = False          # Qwen3: RMSNorm on each head of q and k
    qk_norm_full: bool = False     # OLMoE: the q and k norms span all heads' width (H * D, KV * D)
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to +-clip_qkv after the norms
    # mixture of experts (kvserve/model/moe_models.py); num_experts 0: every layer's MLP is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None      # None: intermediate_size (Mixtral)
    norm_topk_prob: bool = False                  # renormalise the top-k router weights
    shared_expert_intermediate_size: int = 0      # Qwen2-MoE: an always-on, sigmoid-gated expert
    shared_expert_gated: bool = True              # (DeepSeek-V2: shared_experts, summed ungated)
    routed_scaling_factor: float = 1.0            # DeepSeek-V2: the top-k router weights times this
    topk_groups: tuple[int, int] | None = None    # DeepSeek: (n_group, topk_group) expert groups
    router_scoring: str = "softmax"               # DeepSeek-V3: "sigmoid", with a selection bias
    decoder_sparse_step: int = 1                  # layer i is MoE if (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()         # ... and i is not listed here (dense MLP)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # set by a family's adapter (kvserve/model/families.py: Phi-3, Gemma 2 / 3)
    hidden_act: str = "silu"       # the MLP gate's activation: silu (SwiGLU), gelu_pytorch_tanh (GeGLU)
    rotary_dim: int | None = None  # RoPE on a head's first rotary_dim dims only (None: all of them)
    query_pre_attn_scalar: float | None = None   # attention scale 1/sqrt(this) (None: 1/sqrt(head_dim))
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None
    layer_windows: list | None = None   # each layer's sliding window, or None (None: sliding_window for all)
    rope_local_theta: float | None = None  # the RoPE base of the windowed layers (None: rope_theta)
    # multi-head latent attention (DeepSeek-V2, kvserve/model/deepseek.py); kv_lora_rank 0: none.
    # head_dim is then a query / key head's width, qk_nope_head_dim + qk_rope_head_dim
    kv_lora_rank: int = 0          # the compressed KV latent each token caches
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0      # the RoPE'd key part, shared by every head, cached beside the latent
    v_head_dim: int = 0
    rope_interleave: bool = True   # DeepSeek rotates adjacent pairs (V3 may say false: rotate-half)

    def kv_cache_rows(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of the two per-token rows each layer caches: K and V (num_kv_heads of
        head_dim each), or with multi-head latent attention the latent (1, kv_lora_rank) and the
        RoPE key part (1, qk_rope_head_dim) -- the K and V pools of kvserve/attention/mla.py."""
        if self.kv_lora_rank:
            return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` (of the whole model) runs experts (transformers' rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def mlp_params(self) -> int:
        """Parameters of every layer's MLP: gate, up, down; in an MoE layer each expert's, the
        router's and the shared expert's with its gate."""
        E = self.hidden_size
        moe = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        S = self.shared_expert_intermediate_size
        expert = 3 * E * (self.moe_intermediate_size or self.intermediate_size)
        per_moe = self.num_experts * (expert + E) + (3 * E * S + E if S else 0)
        return (self.num_layers - moe) * 3 * E * self.intermediate_size + moe * per_moe

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = find_architecture(archs)
        if arch is None:
            raise ValueError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; kvserve runs "
                f"{', '.join(ARCHITECTURES)}.")
        family = architecture(arch)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if rope.get("rope_type", "default") != "default":
            scaling = rope
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
            scaling = {"max_position_embeddings": cfg.get("max_position_embeddings", 2048), **scaling}
        sliding = cfg.get("sliding_window")
        if family.sliding_window_opt_in and not cfg.get("use_sliding_window", False):
            sliding = None
        defaults = family.defaults
        adapted = family.adapt("config_fields")
        return cls(**{**dict(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", defaults.get("attention_bias", False))),
            qk_norm=defaults.get("qk_norm", False),
            qk_norm_full=defaults.get("qk_norm_full", False),
            clip_qkv=cfg.get("clip_qkv"),
            num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size"),
            norm_topk_prob=cfg.get("norm_topk_prob", defaults.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0,
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            hidden_act=cfg.get("hidden_act") or "silu",
        ), **(adapted(cfg) if adapted else {})})
