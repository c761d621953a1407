"""kvserve's configuration: the flat user-facing `EngineConfig` (vLLM's EngineArgs: `LLM(model,
**kwargs)` and the CLI flags, generated from its fields by cli_args.py) and the immutable nested
`Config` it resolves to once the model is known (`EngineConfig.resolve(model_config)`, resolved.py)."""
from kvserve.config.engine_config import CPU_SPEC_DISABLE_BY_BATCH_SIZE, EngineConfig
from kvserve.config.resolved import (CacheConfig, Config, ModelLoadConfig, ParallelConfig, SchedulerConfig,
                                     TierConfig)
from kvserve.config.speculative import SpeculativeConfig

__all__ = ["CPU_SPEC_DISABLE_BY_BATCH_SIZE", "CacheConfig", "Config", "EngineConfig",
           "ModelLoadConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "TierConfig"]
