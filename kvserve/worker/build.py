"""The one place a model is built (vLLM's model loader): the engine core, a tensor-parallel
worker, the draft proposer and the embedder all call `build_model`.

    resolve_for_checkpoint(engine_config) -> Config      every "auto" decided against the checkpoint's
                                                         headers (no tensor is read)
    build_model(config.model, block_size, kv_cache_dtype, device, rank=, tp_size=, attention=)
        -> BuiltModel(model: this rank's slice, config: the whole model's ModelConfig, tokenizer)

The architecture registry (kvserve/model/registry.py) names the model class; `attention` is the
backend class (kvserve/model/attention.py) every layer of it attends through. With tp_size > 1
the weights are sliced for `rank` (kvserve/model/sharding.py) before the class sees them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.model.attention import AttentionBackend, TorchPagedAttention
from kvserve.model.config import ModelConfig
from kvserve.model.loader import checkpoint_dtype, load_model_dir, read_model_config, resolve_dtype
from kvserve.model.registry import architecture
from kvserve.model.sharding import TPGroup, shard_config, shard_weights
from kvserve.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.config.engine_config import EngineConfig
    from kvserve.config.resolved import Config, ModelLoadConfig


@dataclass
class BuiltModel:
    model: object               # the registry's class for this architecture (LlamaModel, ...)
    config: ModelConfig         # the whole model's (a rank's slice is model.cfg)
    tokenizer: Tokenizer | None


def resolve_for_checkpoint(config: "EngineConfig") -> "Config":
    """`config` resolved (config/resolved.py) against its checkpoint: dtype "auto" becomes the
    checkpoint's dtype or this CPU's fastest for it (loader.resolve_dtype), max_model_len the
    model's context unless asked for less. Reads headers and config.json only."""
    if config.dtype == "auto":
        dtype = resolve_dtype("auto", checkpoint_dtype(config.model), torch.device(config.device))
        config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    return config.resolve(read_model_config(config.model))


def build_model(load: "ModelLoadConfig", block_size: int, kv_cache_dtype: str, device: torch.device, *,
                rank: int = 0, tp_size: int = 1,
                attention: type[AttentionBackend] = TorchPagedAttention) -> BuiltModel:
    """Load `load.model` and build rank `rank` of `tp_size` of it on `device`. A GGUF file's
    tensors load in their own types unless quantization "dequant" asks for `load.dtype`."""
    cfg, weights, tokenizer = load_model_dir(load.model, native=load.quantization != "dequant",
                                             dtype=load.torch_dtype, device=device)
    run_cfg, tp = cfg, None
    if tp_size > 1:
        run_cfg = shard_config(cfg, tp_size)
        weights = shard_weights(weights, cfg, rank, tp_size)
        tp = TPGroup(rank, tp_size, cfg.vocab_size)
    model_class = architecture(cfg.architecture).model_class()
    model = model_class(run_cfg, weights, attention.for_model(run_cfg, block_size, kv_cache_dtype), device,
                        load.torch_dtype, load.quantization, load.quantization_group_size, tp=tp,
                        quantize_activations=load.quantize_activations)
    return BuiltModel(model, cfg, tokenizer)
