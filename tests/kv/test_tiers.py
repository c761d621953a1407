"""KV tiers below the pool (seed 003, "Tiers of KV storage"; kv/connector.py, kv/tiers.py):
outputs after a reload from a CPU, disk or Redis tier equal outputs computed from scratch
(float32 and int8 KV, stories260K and a random Llama), a restarted engine hits its disk tier,
two engines share a Redis store but never across cache salts, a corrupt stored block is
recomputed, the reload/recompute rule, and check_integrity() after every step of a random run."""
from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.kv.block_io import pack_block, unpack_block
from kvserve.kv.disk_store import DiskStore
from kvserve.kv.reload_rule import ReloadRule
from kvserve.kv.tiers import CpuStore, parse_size, parse_tier_spec
from kvserve.sample.params import SamplingParams
from tests.conftest import STORIES_C
from tests.redis_live import redis_server

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BS = 4


def make_engine(model=STORIES_C, **kw) -> LLMEngine:
    kw.setdefault("block_size", BS)
    kw.setdefault("max_num_batched_tokens", 256)
    return LLMEngine(EngineConfig(model=str(model), device="cpu", **kw))


def run(engine, prompts, salt=None, check=True, params=GREEDY) -> dict:
    """Serve prompts one after another (so evictions happen between them); check_integrity()
    after every step. Returns {index: (output tokens, num_cached_tokens)}."""
    out = {}
    for i, p in enumerate(prompts):
        rid = f"r{i}-{random.random()}"
        engine.add_request(rid, {"prompt_token_ids": p}, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[i] = (o.outputs[0].token_ids, o.num_cached_tokens)
            if check:
                engine.check_integrity()
    return out


def workload(seed=0, n=4, plen=30):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 500) for _ in range(plen)] for _ in range(n)]


def reference(prompts, model=STORIES_C, **kw):
    eng = make_engine(model, enable_prefix_caching=False, **kw)
    return {i: t for i, (t, _) in run(eng, prompts, check=False).items()}


def tier_hits(engine) -> int:
    return sum(t["hit_blocks"] for t in engine.stats().kv_tiers["tiers"])


# -- stores and payloads -----------------------------------------------------------------------
def test_payload_checksum_detects_corruption_and_wrong_key():
    key, data = os.urandom(32), os.urandom(100)
    p = pack_block(key, data)
    assert bytes(unpack_block(key, p, 100)) == data
    bad = bytearray(p)
    bad[50] ^= 1
    assert unpack_block(key, bytes(bad), 100) is None
    assert unpack_block(os.urandom(32), p, 100) is None           # another block's payload
    assert unpack_block(key, p[:-1], 100) is None and unpack_block(key, None, 100) is None


def test_cpu_store_lru_hands_back_what_it_evicts():
    s = CpuStore(capacity=250)
    assert s.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100)]) == []
    s.get(b"a")                                                   # a is now most recent
    out = s.put_many([(b"c", b"z" * 100)])
    assert out == [(b"b", b"y" * 100)] and s.contains_many([b"a", b"b", b"c"]) == [True, False, True]


def test_disk_store_survives_a_restart_and_stays_under_capacity(tmp_path):
    s = DiskStore(str(tmp_path), capacity=1000)
    s.put_many([(bytes([i]) * 32, bytes([i]) * 300) for i in range(5)])
    s.close()
    s2 = DiskStore(str(tmp_path), capacity=1000)
    blocks, nbytes = s2.usage()
    assert blocks == 3 and nbytes == 900                          # the two oldest were evicted
    assert s2.get(bytes([4]) * 32) == bytes([4]) * 300 and s2.get(bytes([0]) * 32) is None
    s2.close()


def test_tier_specs_and_config_errors(tmp_path):
    assert parse_size("4GiB") == 4 << 30 and parse_size("500MB") == 500_000_000
    assert isinstance(parse_tier_spec(f"disk:{tmp_path}:1MiB"), DiskStore)
    with pytest.raises(ValueError, match="unknown kv tier"):
        EngineConfig(model="x", kv_tiers="tape:1GiB")
    with pytest.raises(ValueError, match="hash prefix cache"):
        EngineConfig(model="x", kv_tiers="cpu:1GiB", prefix_cache="radix")
    assert EngineConfig(model="x", kv_tiers="cpu:1GiB, disk:/tmp/x:2GiB").kv_tier_list == ("cpu:1GiB", "disk:/tmp/x:2GiB")


def test_reload_rule_is_seed_003s_break_even():
    rule = ReloadRule(m_kv=1000.0)
    assert rule.reload_wins(1.0)                                  # unmeasured: reload
    rule.observe_forward([(None, 100, None)], 0.01)               # 10,000 tokens/s of prefill
    assert rule.break_even_bandwidth == pytest.approx(1e7)        # m_KV x Theta_prefill
    assert rule.reload_wins(2e7) and not rule.reload_wins(5e6)
    rule.observe_forward([(None, 1, None)] * 50, 10.0)            # decode steps are not counted
    assert rule.prefill_throughput == pytest.approx(1e4)
    assert ReloadRule(1.0, "never").reload_wins(1e12) is False


# -- exactness after a reload ------------------------------------------------------------------
REDIS_PROCS: dict[str, subprocess.Popen] = {}


@pytest.fixture
def redis_url():
    with redis_server() as (url, proc):
        REDIS_PROCS[url] = proc
        yield url
        REDIS_PROCS.pop(url, None)


def tier_spec(kind, tmp_path, redis_url=None):
    return {"cpu": ["cpu:1MiB"], "disk": [f"disk:{tmp_path / 'kv'}:4MiB"], "redis": [redis_url],
            "cpu+disk": ["cpu:12KiB", f"disk:{tmp_path / 'kv'}:4MiB"]}[kind]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("kind", ["cpu", "disk", "redis", "cpu+disk"])
def test_outputs_after_a_tier_reload_equal_outputs_from_scratch(kind, kv_dtype, tmp_path, request):
    url = request.getfixturevalue("redis_url") if kind == "redis" else None
    prompts = workload(1)
    ref = reference(prompts, kv_cache_dtype=kv_dtype)
    eng = make_engine(num_kv_blocks=12, kv_cache_dtype=kv_dtype, kv_tiers=tier_spec(kind, tmp_path, url),
                      kv_tier_reload="always")
    first = run(eng, prompts)                   # 12 blocks hold one request: the others are evicted
    again = run(eng, prompts)
    assert {i: t for i, (t, _) in first.items()} == ref
    assert {i: t for i, (t, _) in again.items()} == ref
    assert all(c > 0 for _, c in again.values())
    stats = eng.stats().kv_tiers
    assert tier_hits(eng) > 0 and stats["reload_decisions"] > 0 and stats["tier_hit_tokens"] > 0
    if kind == "cpu+disk":
        assert stats["tiers"][0]["demoted_blocks"] > 0 or stats["tiers"][1]["hit_blocks"] > 0
    eng.shutdown()


def test_random_llama_reload_is_exact(random_model_dir, tmp_path):
    model = random_model_dir("llama")
    prompts = workload(2, n=3, plen=40)
    ref = reference(prompts, model=model)
    eng = make_engine(model, num_kv_blocks=14, kv_tiers=["cpu:1MiB"], kv_tier_reload="always")
    run(eng, prompts)
    again = run(eng, prompts)
    assert {i: t for i, (t, _) in again.items()} == ref and tier_hits(eng) > 0


def test_never_policy_recomputes_and_counts_the_decision(tmp_path):
    prompts = workload(3, n=3)
    eng = make_engine(num_kv_blocks=12, kv_tiers=["cpu:1MiB"], kv_tier_reload="never")
    run(eng, prompts)
    again = run(eng, prompts)
    stats = eng.stats().kv_tiers
    assert tier_hits(eng) == 0 and stats["recompute_decisions"] > 0
    assert {i: t for i, (t, _) in again.items()} == reference(prompts)


# -- persistence, sharing, isolation, corruption -------------------------------------------------
def test_restarted_engine_hits_its_disk_tier(tmp_path):
    prompts = workload(4, n=1)
    tiers = [f"disk:{tmp_path / 'kv'}:4MiB"]
    a = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    first = run(a, prompts)
    a.shutdown()                                  # flushes the last step's blocks to disk
    del a
    b = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    again = run(b, prompts)
    assert first[0][1] == 0 and again[0][1] > 0 and again[0][0] == first[0][0]
    assert b.stats().kv_tiers["tiers"][0]["hit_blocks"] > 0


def test_two_engines_share_redis_but_never_across_salts(redis_url):
    prompts = workload(5, n=1)
    a = make_engine(num_kv_blocks=64, kv_tiers=[redis_url])
    b = make_engine(num_kv_blocks=64, kv_tiers=[redis_url], kv_tier_reload="always")   # not the rule
    first = run(a, prompts, salt="tenant-1")
    a.shutdown()
    other = run(b, prompts, salt="tenant-2")      # same tokens, another salt: no hit
    assert other[0][1] == 0 and tier_hits(b) == 0
    same = run(b, prompts, salt="tenant-1")       # B reloads what A computed
    assert same[0][1] > 0 and tier_hits(b) > 0
    assert same[0][0] == first[0][0] == other[0][0]
    b.shutdown()


def test_a_shared_store_never_crosses_weights(tmp_path):
    """Same model path and tokens, other weight quantization: other K/V, so no hit."""
    prompts = workload(10, n=1)
    tiers = [f"disk:{tmp_path / 'kv'}:4MiB"]
    a = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    run(a, prompts)
    a.shutdown()
    b = make_engine(num_kv_blocks=64, kv_tiers=tiers, quantization="int8")
    assert run(b, prompts)[0][1] == 0 and tier_hits(b) == 0
    c = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    assert run(c, prompts)[0][1] > 0


def test_corrupt_stored_block_is_detected_and_recomputed(tmp_path):
    prompts = workload(6, n=1, plen=30)
    tiers = [f"disk:{tmp_path / 'kv'}:4MiB"]
    a = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    first = run(a, prompts)
    a.shutdown()
    files = sorted(Path(tmp_path / "kv").rglob("*.kvb"), key=lambda f: f.stat().st_mtime)
    victim = files[2]                             # the third block of the chain (written in order)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    b = make_engine(num_kv_blocks=64, kv_tiers=tiers)
    again = run(b, prompts)
    t = b.stats().kv_tiers["tiers"][0]
    assert t["corrupt_blocks"] == 1 and again[0][0] == first[0][0]
    assert 0 < again[0][1] < 7 * BS               # the hit stops before the corrupt block
    b.shutdown()


def test_random_workload_keeps_integrity_and_exactness(tmp_path):
    rng = random.Random(7)
    system = [1] + [rng.randrange(3, 500) for _ in range(17)]
    prompts = [system + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(10)]
    prompts += [prompts[rng.randrange(10)] for _ in range(6)]
    ref = reference(prompts)
    eng = make_engine(num_kv_blocks=rng.choice([10, 12, 16]), max_num_seqs=3, max_num_batched_tokens=24,
                      kv_tiers=["cpu:8KiB", f"disk:{tmp_path / 'kv'}:1MiB"])
    for i, p in enumerate(prompts):               # several requests in flight at once
        eng.add_request(f"q{i}", {"prompt_token_ids": p}, GREEDY)
    got = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                got[int(o.request_id[1:])] = o.outputs[0].token_ids
        eng.check_integrity()
    assert got == ref and tier_hits(eng) > 0
    eng.shutdown()


def test_auto_rule_recomputes_when_the_tier_is_slower_than_prefill():
    prompts = workload(8, n=3)
    eng = make_engine(num_kv_blocks=12, kv_tiers=["cpu:1MiB"])           # kv_tier_reload="auto"
    run(eng, prompts)
    st = eng.stats().kv_tiers
    assert st["prefill_tokens_per_s"] > 0 and st["break_even_bandwidth"] > 0   # measured
    eng.kv.connector.stats[0].bandwidth = st["break_even_bandwidth"] / 2     # a slow tier
    again = run(eng, prompts)
    st = eng.stats().kv_tiers
    assert st["recompute_decisions"] > 0 and st["tiers"][0]["reload_wins"] is False and tier_hits(eng) == 0
    assert {i: t for i, (t, _) in again.items()} == reference(prompts)


def test_a_redis_server_that_goes_away_is_a_miss_not_a_failure(redis_url):
    prompts = workload(9, n=3)
    eng = make_engine(num_kv_blocks=12, kv_tiers=["cpu:16KiB", redis_url], kv_tier_reload="always")
    run(eng, prompts)
    REDIS_PROCS[redis_url].terminate()            # the shared store goes away mid-run
    REDIS_PROCS[redis_url].wait(timeout=10)
    again = run(eng, prompts)
    assert {i: t for i, (t, _) in again.items()} == reference(prompts)
    assert eng.stats().kv_tiers["tiers"][1]["failures"] >= 1


def test_prefill_on_one_engine_decode_on_another_through_redis(redis_url):
    """The building block of disaggregation (issue 13 part 3, not the serving layer): engine A
    prefills the prompt and samples the first token; engine B, sharing only the Redis store,
    reloads the prompt's K/V and continues: the tokens equal a collocated run's."""
    prompt = workload(11, n=1, plen=41)[0]
    full = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    col = make_engine(num_kv_blocks=64, enable_prefix_caching=False)
    col.add_request("c", {"prompt_token_ids": prompt}, full)
    expected = None
    while col.has_unfinished_requests():
        expected = next((o.outputs[0].token_ids for o in col.step() if o.finished), expected)
    a = make_engine(num_kv_blocks=64, kv_tiers=[redis_url])
    first, _ = run(a, [prompt], params=SamplingParams(max_tokens=1, temperature=0.0))[0]   # prefill only
    a.shutdown()                                            # flushes the prompt's blocks
    b = make_engine(num_kv_blocks=64, kv_tiers=[redis_url], kv_tier_reload="always")
    b.add_request("d", {"prompt_token_ids": prompt + first[:1]},
                  SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    out = None
    while b.has_unfinished_requests():
        for o in b.step():
            out = o if o.finished else out
        b.check_integrity()
    assert out.num_cached_tokens == len(prompt) // BS * BS
    assert first[:1] + out.outputs[0].token_ids == expected
    b.shutdown()
