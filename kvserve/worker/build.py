"""The one place a model is built (vLLM's model loader): the engine core, a tensor-parallel
worker, the draft proposer and the embedder all call `build_model`.

    load_and_resolve(engine_config) -> (Config, loaded)             the file read once; every "auto"
                                                         decided: dtype, kv_cache_dtype,
                                                         max_model_len, the attention backend
    build_model(config.model, block_size, kv_cache_dtype, device, rank=, tp_size=, attention=, loaded=)
        -> BuiltModel(model: this rank's slice, config: the whole model's ModelConfig, tokenizer)

The architecture registry (kvserve/model/registry.py) names the model class; every layer attends
through `load.attention_backend` (kvserve/attention/selector.py; `attention`, a backend class,
overrides it: the embedder's prompt-only attention). With tp_size > 1 the weights are sliced for
`rank` (kvserve/model/sharding.py) before the class sees them.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.attention.backend import AttentionBackend
from kvserve.attention.selector import select_attention_backend
from kvserve.config.names import DTYPE_NAMES
from kvserve.worker.device import cuda_available, resolve_device, torch_dtype
from kvserve.model.config import ModelConfig
from kvserve.model.loaders.checkpoint import checkpoint_types, load_model_dir, resolve_dtype
from kvserve.model.registry import architecture
from kvserve.model.sharding import TPGroup, check_expert_parallel, shard_config, shard_weights
from kvserve.model.stages import stage_config, stage_of, stage_weights
from kvserve.model.tokenizers.tokenizer import Tokenizer

if TYPE_CHECKING:
    from kvserve.config.engine_config import EngineConfig
    from kvserve.config.resolved import Config, ModelLoadConfig

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    model: object               # the registry's class for this architecture (LlamaModel, ...)
    config: ModelConfig         # the whole model's (a rank's slice is model.cfg)
    tokenizer: Tokenizer | None


def with_checkpoint_dtype(config: "EngineConfig") -> "EngineConfig":
    """`config` with dtype "auto" decided: the checkpoint's dtype, or this CPU's fastest for it
    (loader.resolve_dtype; reads the checkpoint's headers only); and kv_cache_dtype "float32"
    (a float32 model's own: "auto") or "auto" (for a GGUF file's quantized weights run in float32:
    "bfloat16", as llama.cpp keeps its cache in float16 -- half the bytes a decode step reads, and
    the file's perplexity within 0.01%: docs/models/quantization.md)."""
    types = functools.cache(lambda: checkpoint_types(config.model))      # the headers read once, if at all
    if config.dtype == "auto":
        dtype = resolve_dtype("auto", types().dtype, torch.device(resolve_device(config.device)))
        config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
    float32 = DTYPE_NAMES[config.dtype] == "float32"
    if config.kv_cache_dtype == "float32":
        if not float32:
            raise ValueError(f"kv_cache_dtype float32 keeps a float32 model's K/V as they are; this model runs "
                             f"in {config.dtype}: give dtype float32 too, or kv_cache_dtype auto.")
        return dataclasses.replace(config, kv_cache_dtype="auto")
    if (config.kv_cache_dtype == "auto" and float32 and config.quantization != "dequant"
            and types().quantized_gguf):
        logger.info("GGUF file of quantized weights run in float32: its KV cache in bfloat16 "
                    "(kv_cache_dtype float32 keeps float32)")
        return dataclasses.replace(config, kv_cache_dtype="bfloat16")
    return config


def load_checkpoint(config, device: torch.device | str) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """(model config, weights, tokenizer) of `config.model` in `config.dtype` (decided; an
    EngineConfig or its resolved ModelLoadConfig section): a GGUF
    file's tensors in their own types unless quantization "dequant" asks for the dtype."""
    return load_model_dir(config.model, native=config.quantization != "dequant", dtype=torch_dtype(config.dtype),   # (raw or parsed)
                          device=device)


def load_and_resolve(config: "EngineConfig") -> tuple["Config", tuple]:
    """The checkpoint read once (`load_checkpoint`, on the device config/resolved.py decides,
    dtype "auto" decided first), and `config` resolved against it: max_model_len the model's
    context unless asked for less, the attention backend for this model's heads here. Returns
    (Config, what build_model takes as `loaded`); `Config.model.device` is where it loaded."""
    config = with_checkpoint_dtype(dataclasses.replace(config, device=resolve_device(config.device)))
    loaded = load_checkpoint(config, config.device)
    model_cfg = loaded[0]
    r = config.resolve(model_cfg, cuda_available())
    tp, ep = r.parallel.tensor_parallel_size, r.parallel.enable_expert_parallel
    check_expert_parallel(model_cfg, ep)
    heads = shard_config(model_cfg, tp, ep) if tp > 1 else model_cfg     # what one rank attends over
    backend = select_attention_backend(r.model.attention_backend, heads, torch.device(r.model.device),
                                       torch_dtype(r.model.dtype), r.cache.kv_cache_dtype)
    return dataclasses.replace(r, model=dataclasses.replace(r.model, attention_backend=backend.name)), loaded


def build_model(load: "ModelLoadConfig", block_size: int, kv_cache_dtype: str, device: torch.device | str, *,
                rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                attention: type[AttentionBackend] | None = None, loaded: tuple | None = None,
                expert_parallel: bool = False) -> BuiltModel:
    """Load `load.model` (or take `loaded`, `load_checkpoint`'s answer for it) and build rank
    `rank` of `tp_size` of it on `device` -- or pipeline stage `pp_rank` of `pp_size`: its layers
    only (model/stages.py; kvserve/distributed/pipeline.py runs it). A GGUF file's tensors load in
    their own types unless quantization "dequant" asks for `load.dtype`. `expert_parallel`: an MoE
    model's ranks hold whole experts, E / tp_size each (model/sharding.py)."""
    device = torch.device(device)
    cfg, weights, tokenizer = loaded or load_checkpoint(load, device)
    run_cfg, tp, stage = cfg, None, {}
    if tp_size > 1 and pp_size > 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size both above 1 is not built: "
                         "choose one of them.")
    if tp_size > 1:
        run_cfg = shard_config(cfg, tp_size, expert_parallel)
        weights = shard_weights(weights, cfg, rank, tp_size)
        tp = TPGroup(rank, tp_size, cfg.vocab_size)
    if pp_size > 1:
        s = stage_of(cfg, pp_rank, pp_size)
        run_cfg, weights, stage = stage_config(cfg, s), stage_weights(weights, cfg, s), {"stage": s}
    if attention is None:
        attention = select_attention_backend(load.attention_backend, run_cfg, device, torch_dtype(load.dtype),
                                             kv_cache_dtype,
                                             log=rank == 0 and load.attention_backend == "auto")
    model_class = architecture(cfg.architecture).model_class()
    if stage and not getattr(model_class, "supports_pipeline", False):
        raise ValueError(f"pipeline_parallel_size > 1 is not built for {cfg.architecture}: use 1.")
    model = model_class(run_cfg, weights, attention.for_model(run_cfg, block_size, kv_cache_dtype), device,
                        torch_dtype(load.dtype), load.quantization, load.quantization_group_size, tp=tp,
                        quantize_activations=load.quantize_activations, **stage)
    return BuiltModel(model, cfg, tokenizer)
