"""kvserve: a readable LLM inference and serving engine (vLLM's public names, on purpose)."""
from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.llm import LLM
from kvserve.outputs import BeamSearchOutput, CompletionOutput, Logprob, RequestOutput
from kvserve.sample.params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "BeamSearchParams", "RequestOutput",
           "CompletionOutput", "BeamSearchOutput", "Logprob"]
