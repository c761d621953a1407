"""`Config`: the engine's configuration once resolved (vLLM's VllmConfig): frozen sections, every
"auto" and None that depends on the model decided once, from `EngineConfig.resolve(model_config)`.
The engine and the API read it and never write it (assigning a field raises FrozenInstanceError).

    config.model.max_model_len      config.cache.block_size     config.scheduler.max_num_seqs
    config.parallel.tensor_parallel_size    config.speculative (None: off)    config.tiers.kv_role
    config.structured_outputs.max_grammar_compile_s

Each flat EngineConfig field lands in exactly one section under its own name (speculative_config
becomes `speculative`, the parsed SpeculativeConfig).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.config.names import DTYPE_NAMES
from kvserve.config.speculative import CPU_SPEC_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

if TYPE_CHECKING:
    from kvserve.config.engine_config import EngineConfig
    from kvserve.model.config import ModelConfig


@dataclass(frozen=True)
class ModelLoadConfig:
    """Which weights, where, in which dtype and quantization, up to which context."""
    model: str
    device: str                         # "cpu" | "cuda" ("auto" decided)
    dtype: str                          # a torch dtype name: "float32" | "bfloat16" | "float16"
                                        # (worker/device.torch_dtype maps it to torch's)
    max_model_len: int                  # <= the model's max_position_embeddings
    quantization: str | None            # None | "int8" | "int4" | "dequant"
    quantization_group_size: int | None
    quantize_activations: bool
    attention_backend: str              # "torch" | "cpu_fused" | "mla" (decided by worker/build.py) | "auto"
    seed: int | None


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool (its size as asked: the block count needs the loaded model) and reuse."""
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool
    prefix_cache: str                   # "hash" | "radix"
    swap_space: int
    share_blocks: bool

    @property
    def prefix_cache_kind(self) -> str | None:
        """The prefix cache in use: "hash", "radix" or None (prefix caching off)."""
        return self.prefix_cache if self.enable_prefix_caching else None


@dataclass(frozen=True)
class SchedulerConfig:
    """Who runs each step, under which budget, and what happens when the pool is full."""
    max_num_batched_tokens: int
    max_num_seqs: int
    watermark: float
    cache_aware_scheduling: bool        # None decided: on with the radix cache
    max_wait_steps: int
    scheduling_policy: str
    preemption_mode: str
    preemption_warn_threshold: int
    async_scheduling: bool              # plan a step ahead while the forward pass runs


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    enable_expert_parallel: bool        # MoE: experts split across the tensor-parallel ranks
    pipeline_parallel_size: int
    pipeline_micro_batches: int         # 0: one per stage
    distributed_executor_backend: str


@dataclass(frozen=True)
class TierConfig:
    """KV tiers below the pool and the disaggregated prefill/decode role."""
    kv_tiers: tuple[str, ...]           # top first; () for none
    kv_tier_reload: str
    kv_role: str
    kv_transfer: str                    # store | stream (layer-wise, over TCP: kv/stream_*.py)
    kv_stream_address: str
    kv_stream_buffer: int               # bytes
    kv_stream_timeout: float
    kv_stream_rate: float               # bytes/s, 0: unlimited
    kv_stream_unit: str                 # layer | prompt


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding (kvserve/structured/)."""
    max_grammar_compile_s: float


@dataclass(frozen=True)
class Config:
    model: ModelLoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    speculative: SpeculativeConfig | None
    tiers: TierConfig
    structured_outputs: StructuredOutputsConfig


def _section(cls, engine: "EngineConfig", **decided):
    """`cls` filled from the same-named fields of `engine`, with `decided` values instead."""
    return cls(**{f.name: decided[f.name] if f.name in decided else getattr(engine, f.name)
                  for f in dataclasses.fields(cls)})


def resolve_device(name: str, cuda_available: bool) -> str:
    """The device a name means: "auto" is cuda when the worker's probe saw a GPU
    (worker/device.cuda_available), else cpu."""
    return ("cuda" if cuda_available else "cpu") if name == "auto" else name


def resolve_speculative(spec: SpeculativeConfig | None, device: str) -> SpeculativeConfig | None:
    """On CPU an unset `disable_by_batch_size` is CPU_SPEC_DISABLE_BY_BATCH_SIZE (config/speculative.py)."""
    if spec is not None and spec.disable_by_batch_size is None and device == "cpu":
        return dataclasses.replace(spec, disable_by_batch_size=CPU_SPEC_DISABLE_BY_BATCH_SIZE)
    return spec


def resolve_config(engine: "EngineConfig", max_pos: int, cuda_available: bool = False) -> Config:
    """Every decision, made once, from an EngineConfig that is never written: the device
    ("auto": cuda where `cuda_available`, the worker's probe), the parsed quantization, speculation with its CPU threshold, the tier list, and
    what depends on the model: max_model_len against its max_position_embeddings (`max_pos`),
    and dtype."""
    max_len = engine.max_model_len or max_pos
    if max_len > max_pos:
        raise ValueError(f"max_model_len {max_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}.")
    # "auto" comes here only from callers that did not read the checkpoint: the engine resolves
    # it against the checkpoint before loading (model/loaders/checkpoint.py `resolve_dtype`).
    dtype = "float32" if engine.dtype == "auto" else DTYPE_NAMES[engine.dtype]
    device = resolve_device(engine.device, cuda_available)
    quantization, group_size = engine.parsed_quantization
    return Config(
        model=_section(ModelLoadConfig, engine, dtype=dtype, max_model_len=max_len, device=device,
                       quantization=quantization, quantization_group_size=group_size),
        cache=_section(CacheConfig, engine),
        scheduler=_section(SchedulerConfig, engine, cache_aware_scheduling=engine.use_cache_aware_scheduling),
        parallel=_section(ParallelConfig, engine),
        speculative=resolve_speculative(engine.speculative, device),
        tiers=_section(TierConfig, engine, kv_tiers=engine.kv_tier_list,
                       kv_stream_buffer=engine.kv_stream_buffer_bytes,
                       kv_stream_rate=float(engine.kv_stream_rate_bytes)),
        structured_outputs=_section(StructuredOutputsConfig, engine))
