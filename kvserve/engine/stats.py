"""What the engine reports (`LLMEngine.stats()`, the server's /metrics): vLLM's counters and
gauges, the prefix cache's, the KV pool's, the swap space's and the step times'."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int = 0    # tokens looked up at admission
    prefix_cache_hits_total: int = 0       # of which served from the cache
    prefix_cache_eligible_total: int = 0   # of which could hit at all (block-size floor, last-token cap)
    num_cached_blocks: int = 0             # blocks labelled in the prefix cache (in use or free)
    num_used_blocks: int = 0               # blocks held by at least one sequence
    num_evictions_total: int = 0           # cached blocks reused for new contents
    num_cow_copies_total: int = 0          # shared blocks copied because a sequence wrote into them
    num_partial_block_copies_total: int = 0  # radix hits on a partial block (copied)
    num_logical_blocks: int = 0            # blocks in all block tables: what no sharing would use
    num_swapped: int = 0                   # sequences in the CPU swap space
    num_swap_preemptions_total: int = 0
    num_swap_out_blocks_total: int = 0
    num_swap_in_blocks_total: int = 0
    num_repeatedly_preempted_total: int = 0  # sequences preempted preemption_warn_threshold times
    max_preemptions_per_request: int = 0
    num_steps: int = 0
    num_async_steps: int = 0               # steps planned and started while the one before ran
    forward_time_total: float = 0.0        # seconds inside the model's forward pass
    step_time_total: float = 0.0
    kv_cache_dtype: str = "auto"           # "auto" (the model dtype) | "bfloat16" | "int8" | "fp8_e4m3" | "fp8_e5m2"
    kv_bytes_per_token: int = 0            # K and V of every layer, scales included
    num_kv_tokens: int = 0                 # tokens the device pool holds: blocks * block_size
    # Speculative decoding (kvserve/spec_decode/; vLLM's spec_decode_* counters; 0 when off)
    spec_decode_num_drafts: int = 0                  # sequences verified with drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)   # [k]
    # KV tiers (kv/connector.py; {} when off): per tier hits, bytes, measured bandwidth; the
    # measured prefill throughput, seed 003's reload break-even and the reload/recompute decisions
    kv_tiers: dict = field(default_factory=dict)
    # Layer-wise KV streaming of a PD pair (engine/remote_kv.py; {} when off): the sender's or
    # the receiver's counters, the decode side's completed transfers and fallbacks by reason
    kv_stream: dict = field(default_factory=dict)
    # Structured outputs (kvserve/structured/; {} until the engine has one): grammar compiles,
    # errors, timeouts, cache hits, the compile-time histogram, requests waiting for a grammar
    structured_outputs: dict = field(default_factory=dict)


def collect_stats(engine) -> EngineStats:
    """A snapshot of `engine`'s counters and gauges."""
    s = engine._stats
    kv, sched, c = engine.kv, engine.scheduler, engine.scheduler.counters
    s.num_running = len(sched.running)
    s.num_waiting = len(sched.waiting)
    s.kv_cache_usage = kv.pool.usage()
    s.num_free_blocks = kv.num_free_blocks
    s.num_total_blocks = kv.pool.num_blocks
    s.num_preemptions_total = c.num_preemptions
    s.prompt_tokens_total = c.prompt_tokens
    s.generation_tokens_total = c.generation_tokens
    s.forward_time_total = engine.runner.forward_time_total   # inside the model's forward
    s.prefix_cache_queries_total = kv.stats.prefix_cache_queries
    s.prefix_cache_hits_total = kv.stats.prefix_cache_hits
    s.prefix_cache_eligible_total = kv.stats.prefix_cache_eligible
    s.num_cached_blocks = kv.num_cached_blocks
    s.num_used_blocks = kv.pool.num_used_blocks
    s.num_evictions_total = kv.pool.num_evictions
    s.num_cow_copies_total = kv.stats.cow_copies
    s.num_partial_block_copies_total = kv.stats.partial_copies
    s.num_logical_blocks = sum(len(t) for t in kv.block_tables.values())
    s.num_swapped = sched.num_swapped
    s.num_swap_preemptions_total = c.num_swap_preemptions
    s.num_swap_out_blocks_total = kv.stats.swap_out_blocks
    s.num_swap_in_blocks_total = kv.stats.swap_in_blocks
    s.num_repeatedly_preempted_total = c.num_repeatedly_preempted
    s.max_preemptions_per_request = c.max_preemptions_per_request
    if getattr(kv, "connector", None) is not None:
        s.kv_tiers = kv.connector.stats_dict()
    if getattr(engine, "kv_stream", None) is not None:
        s.kv_stream = engine.kv_stream.stats_dict()
    if getattr(engine, "grammars", None) is not None:
        s.structured_outputs = engine.grammars.stats()
    spec = getattr(engine, "spec", None)
    if spec is not None:
        st = spec.stats
        s.spec_decode_num_drafts = st.num_drafts
        s.spec_decode_num_draft_tokens = st.num_draft_tokens
        s.spec_decode_num_accepted_tokens = st.num_accepted_tokens
        s.spec_decode_num_accepted_tokens_per_pos = list(st.accepted_per_pos)
    return EngineStats(**vars(s))
