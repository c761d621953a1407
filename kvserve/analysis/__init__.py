"""kvserve.analysis: the seeds' analytic tools as a planning toolkit.

specs       hardware and model specs (presets, HF config.json, --measure)
roofline    arithmetic intensity, attainable performance, roofline plots (seed 000)
kvmath      KV bytes, contexts in a budget, decode ceilings, Little's law (seed 001)
stepmodel   seed 003's step-time model, knee batch, chunk budget, calibration fit
simulate    static / continuous / chunked-prefill scheduling simulators (seeds 000, 003)
paging      block allocator, reserve vs paged vs shared memory policies, preemption (seed 003)
prefix      prefix-cache hit rates: chained block hashes vs radix tree (seeds 000, 003)
disagg      swap vs recompute, KV tiers, KV transfer, disaggregation planner (seed 003)
"""
from .specs import HARDWARE, MODELS, HardwareSpec, ModelSpec, get_hardware, get_model, model_from_hf_config
from .stepmodel import StepModel, fit_step_model

__all__ = ["HARDWARE", "MODELS", "HardwareSpec", "ModelSpec", "get_hardware", "get_model",
           "model_from_hf_config", "StepModel", "fit_step_model"]
