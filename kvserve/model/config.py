"""ModelConfig: the architecture facts the forward pass needs, read from an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.model.registry import ARCHITECTURES, architecture, find_architecture

# EngineConfig.dtype spellings -> the torch dtype name
DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}

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
            attention_bias=cfg.get("attention_bias", defaults.get("attention_bias", False)),
            qk_norm=defaults.get("qk_norm", False),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            hidden_act=cfg.get("hidden_act") or "silu",
        ), **(adapted(cfg) if adapted else {})})
