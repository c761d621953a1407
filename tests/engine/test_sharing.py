"""Where users see KV reuse and sharing, on the real stories260K model: n > 1 samples share the
prompt's blocks and still equal separately seeded requests; cache_salt scopes sharing;
num_cached_tokens and the prefix-cache metrics explain themselves; swap and recompute give the
same outputs; cache-aware ordering serves cached prefixes first without starving anyone; bad
input and aborts never leak blocks."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.kv.manager import KVCacheManager
from tests.conftest import STORIES_HF

# Every test here runs on the model-dtype KV cache and again on an int8 one (conftest.kv_cache_dtype).
pytestmark = pytest.mark.usefixtures("kv_cache_dtype")

PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside"


def run_tracking_blocks(llm, prompt, params):
    """Run one request step by step; return (output, peak blocks in use)."""
    eng = llm.engine
    eng.add_request("r", prompt, params)
    peak, out = 0, None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
        peak = max(peak, eng.kv.pool.num_used_blocks)
        eng.check_integrity()
    return out, peak


def test_n_samples_share_the_prompt_and_equal_separate_seeded_requests():
    params = SamplingParams(n=4, temperature=1.0, seed=21, max_tokens=12, ignore_eos=True)
    shared, peak_shared = run_tracking_blocks(LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256), PROMPT, params)
    alone, peak_alone = run_tracking_blocks(
        LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256, share_blocks=False, enable_prefix_caching=False), PROMPT, params)
    assert [c.token_ids for c in shared.outputs] == [c.token_ids for c in alone.outputs]
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256)
    for i, c in enumerate(shared.outputs):
        single = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=21 + i, max_tokens=12,
                                                      ignore_eos=True))[0].outputs[0]
        assert c.token_ids == single.token_ids
    assert peak_shared < peak_alone
    assert llm.engine.stats().num_free_blocks == llm.engine.kv.pool.num_blocks


def test_cache_salt_scopes_sharing():
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256)
    p = SamplingParams(temperature=0, max_tokens=4)
    a1 = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-a"}, p)[0]
    b = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-b"}, p)[0]
    plain = llm.generate(PROMPT, p)[0]
    a2 = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-a"}, p)[0]
    assert a1.num_cached_tokens == 0 and b.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert a2.num_cached_tokens > 0
    assert a1.outputs[0].token_ids == b.outputs[0].token_ids == a2.outputs[0].token_ids


def test_metrics_explain_the_block_size_floor():
    llm = LLM(str(STORIES_HF), block_size=16, num_kv_blocks=64)
    p = SamplingParams(temperature=0, max_tokens=2)
    short = [1, 300, 301, 302, 303, 304]               # shorter than one block: can never hit
    llm.generate({"prompt_token_ids": short}, p)
    out = llm.generate({"prompt_token_ids": short}, p)[0]
    st = llm.engine.stats()
    assert out.num_cached_tokens == 0
    assert st.prefix_cache_queries_total == 12 and st.prefix_cache_eligible_total == 0
    assert st.prefix_cache_hits_total == 0
    long = [1] + list(range(100, 140))                 # 41 tokens: 2 full blocks can hit
    llm.generate({"prompt_token_ids": long}, p)
    out = llm.generate({"prompt_token_ids": long}, p)[0]
    st = llm.engine.stats()
    assert out.num_cached_tokens == 32 and st.prefix_cache_hits_total == 32
    assert st.prefix_cache_eligible_total == 64 and st.num_cached_blocks >= 2


def test_swap_and_recompute_give_identical_outputs():
    prompts = [PROMPT, "The cat sat on the mat and", "Tom and his dog went to the park to play", "Lily"]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    outs = {}
    for mode in ("recompute", "swap"):
        llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=40, preemption_mode=mode)
        outs[mode] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        st = llm.engine.stats()
        assert st.num_preemptions_total > 0
        if mode == "swap":
            assert st.num_swap_preemptions_total > 0 and st.num_swap_out_blocks_total > 0
        llm.engine.check_integrity()
        assert st.num_free_blocks == llm.engine.kv.pool.num_blocks
    assert outs["recompute"] == outs["swap"]


def test_repeated_preemption_is_reported():
    llm = LLM(str(STORIES_HF), block_size=2, num_kv_blocks=40, watermark=0.0, preemption_warn_threshold=1)
    llm.generate(["Lily", "Tom", "The dog", "A cat"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    st = llm.engine.stats()
    assert st.num_preemptions_total > 0
    assert st.num_repeatedly_preempted_total > 0 and st.max_preemptions_per_request >= 1


def test_abort_of_a_sharing_group_frees_everything():
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256)
    eng = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=50, ignore_eos=True)
    eng.add_request("before-fork", PROMPT, params)
    eng.abort_request("before-fork")                   # samples still waiting to fork
    eng.add_request("mid", PROMPT, params)
    eng.add_request("beams", PROMPT, SamplingParams(use_beam_search=True, beam_width=3, max_tokens=20))
    for _ in range(6):
        eng.step()
        eng.check_integrity()
    assert eng.stats().num_logical_blocks > eng.stats().num_used_blocks     # sharing is live
    eng.abort_request(["mid", "beams"])
    eng.check_integrity()
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.kv.num_free_blocks == eng.kv.pool.num_blocks


@pytest.mark.parametrize("prompt, words", [({"prompt": "hi", "cache_salt": 7}, "cache_salt"),
                                            ({"prompt": "hi", "salt": "x"}, "unknown prompt field")])
def test_bad_cache_salt_is_rejected_without_leaks(prompt, words):
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=256)
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request("bad", prompt, SamplingParams())
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def _scheduler(max_wait_steps):
    kv = KVCacheManager(64, 4, prefix_cache="radix")
    warm = Request("warm", list(range(10, 30)), SamplingParams())
    kv.allocate_prefill(warm, kv.lookup(warm), warm.num_tokens)
    warm.num_computed_tokens = warm.num_tokens
    kv.cache_blocks(warm)
    kv.free("warm", warm)
    return Scheduler(kv, max_num_batched_tokens=8, max_num_seqs=1, cache_aware=True,
                     max_wait_steps=max_wait_steps)


@pytest.mark.parametrize("max_wait_steps, first", [(64, "cached"), (0, "cold")])
def test_cache_aware_order_and_its_starvation_bound(max_wait_steps, first):
    sched = _scheduler(max_wait_steps)
    cold = Request("cold", list(range(300, 320)), SamplingParams(), arrival_time=1.0)
    cached = Request("cached", list(range(10, 30)) + [5, 6], SamplingParams(), arrival_time=2.0)
    sched.add(cold)
    sched.add(cached)
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == [first]
    if first == "cached":
        assert cached.num_cached_tokens == 20


def test_engines_here_run_on_the_cache_the_fixture_names(kv_cache_dtype):
    llm = LLM(str(STORIES_HF), block_size=4, num_kv_blocks=16)
    assert llm.engine.config.cache.kv_cache_dtype == kv_cache_dtype
    assert isinstance(llm.engine.runner.kv_caches[0][0], tuple) == (kv_cache_dtype == "int8")
