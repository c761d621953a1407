"""Structured outputs in the engine with everything else: mixed batches (masks only on the
constrained rows), n > 1 (each sample its own matcher), speculation (off for constrained
sequences), bad input (a clear ValueError at add, nothing queued), the compile bound
(WAITING_FOR_GRAMMAR ends with an error, others never wait), aborts (the matcher is freed),
min_tokens against a complete grammar, and the metrics."""
from __future__ import annotations

import gc
import json
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.request import RequestStatus
from kvserve.server.metrics import _EngineStatsCollector
from kvserve.structured import StructuredOutputsParams as SO, check_structured_outputs
from kvserve.structured import compiler
from kvserve.structured.matcher import num_live_matchers
from tests.conftest import STORIES_C, STORIES_HF

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINED = [SO(choice=["yes", "no"]), SO(regex=r"(Tom|Lily) (ran|sat)\."), SO(json=SCHEMA), SO(json_object=True)]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES_HF), num_kv_blocks=256, max_num_seqs=16)


def texts(outs) -> list[list[tuple[list[int], str]]]:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def drive(eng, limit_s: float = 30.0) -> dict:
    """Step until nothing is left (integrity checked every step); finished outputs by id."""
    done, t0 = {}, time.monotonic()
    while eng.has_unfinished_requests():
        assert time.monotonic() - t0 < limit_s, "the engine hangs"
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.check_integrity()
    return done


def test_mixed_batch_equals_each_request_alone(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True)]
    constrained = [SamplingParams(temperature=t, seed=11, max_tokens=48, structured_outputs=so)
                   for so in CONSTRAINED for t in (0.0, 1.0)]
    params = free + constrained
    prompts = ["Once upon a time", "Lily and Tom"] + ["Tom said:"] * len(constrained)
    together = texts(llm.generate(prompts, params))
    alone = [texts(llm.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    assert together == alone
    for so, (tokens, reason) in zip([c.structured_outputs for c in constrained], [t[0] for t in together[2:]]):
        text = llm.engine.tokenizer.decode(tokens)
        if so.json is not None and reason == "stop":
            out = json.loads(text)                  # keys in the schema's order, not sorted
            assert list(out) == ["name", "age"] and 0 <= out["age"] <= 99
    assert [r for _, r in (t[0] for t in together[2:4])] == ["stop", "stop"]     # a choice ends itself


@pytest.mark.parametrize("share_blocks", [True, False])
def test_each_sample_has_its_own_matcher(share_blocks):
    llm = LLM(str(STORIES_HF), num_kv_blocks=128, share_blocks=share_blocks)
    so = SO(regex=r"(Tom|Lily|Sue) (ran|sat|had) [a-z]{2,6}\.")
    n = llm.generate(["Once"], SamplingParams(n=4, seed=5, temperature=1.2, max_tokens=24, structured_outputs=so))
    alone = [llm.generate(["Once"], SamplingParams(seed=5 + i, temperature=1.2, max_tokens=24,
                                                   structured_outputs=so))[0].outputs[0] for i in range(4)]
    assert [c.token_ids for c in n[0].outputs] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in alone}) > 1         # the samples differ: the test can fail


def test_speculation_skips_constrained_sequences():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompt = "Tom had a red ball. Tom had a red ball. Tom had a red ball. Tom"
    so = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=r"( had a red ball\.)+"))
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    base, llm = LLM(str(STORIES_C)), LLM(str(STORIES_C), speculative_config=spec)
    assert texts(llm.generate([prompt], [so])) == texts(base.generate([prompt], [so]))
    assert llm.engine.stats().spec_decode_num_drafts == 0          # never drafted for a grammar
    assert texts(llm.generate([prompt, prompt], [so, free])) == texts(base.generate([prompt, prompt], [so, free]))
    assert llm.engine.stats().spec_decode_num_drafts > 0           # the free one still speculates


BAD = [(SO(regex="a(b"), "unclosed group"), (SO(json={"type": "foo"}), "Invalid type: foo"),
       (SO(json={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable schema"),
       (SO(grammar="start: foo"), 'unknown name: "foo"'), (SO(grammar="root ::= (\"a\""), "does not compile|GBNF"),
       (SO(json={"properties": {"a": {"$ref": "#/nope"}}}), "does not exist")]


@pytest.mark.parametrize("so, words", BAD, ids=[str(so.key)[:40] for so, _ in BAD])
def test_bad_grammar_is_refused_at_add_and_nothing_is_queued(llm, so, words):
    eng = llm.engine
    with pytest.raises(ValueError, match=words):
        check_structured_outputs(so, eng)
    eng.add_request("ok", "Tom", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match=words):
        eng.add_request("bad", "Tom", SamplingParams(structured_outputs=so))
    assert set(eng.core.groups) == set(eng.output.requests) == {"ok"} and len(eng.core.grammars) == 0
    assert set(drive(eng)) == {"ok"}
    check_structured_outputs(SamplingParams(structured_outputs=SO(regex="a+")), eng.tokenizer)


def test_a_slow_compile_fails_alone_and_the_loop_never_waits_for_it(monkeypatch):
    real = compiler.compile_matcher

    def slow(params, ll_tok):
        if params.regex == "slow":
            time.sleep(0.6)
        return real(params, ll_tok)

    monkeypatch.setattr(compiler, "compile_matcher", slow)
    llm = LLM(str(STORIES_HF), num_kv_blocks=64, max_grammar_compile_s=0.2)
    eng = llm.engine
    eng.add_request("slow", "Tom", SamplingParams(max_tokens=8, structured_outputs=SO(regex="slow")))
    eng.add_request("free", "Tom", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    t0, steps, done = time.monotonic(), [], {}
    while eng.has_unfinished_requests():
        s0 = time.monotonic()
        for out in eng.step():
            done[out.request_id] = (out, time.monotonic() - t0) if out.finished else None
        steps.append(time.monotonic() - s0)
        eng.check_integrity()
        if "free" in done and "slow" not in done:     # the free one never waited for the grammar
            assert eng.core.groups["slow"][0].status == RequestStatus.WAITING_FOR_GRAMMAR
        assert time.monotonic() - t0 < 5, "the engine hangs"
    (slow_out, t_slow), (free_out, t_free) = done["slow"], done["free"]
    # (the deadline runs from the compile's start, inside add_request: before t0)
    assert free_out.outputs[0].finish_reason == "length" and t_free < 0.2 and 0.15 <= t_slow < 0.5
    assert slow_out.outputs[0].finish_reason == "error"
    assert "did not compile within max_grammar_compile_s=0.2 s" in slow_out.outputs[0].error
    assert max(steps) < 0.1                              # no step blocked on the compile
    assert eng.stats().structured_outputs["timeouts"] == 1
    time.sleep(0.6)              # the compile finishes in the background and fills the cache
    out = llm.generate(["Tom"], SamplingParams(max_tokens=8, structured_outputs=SO(regex="slow")))[0]
    assert out.outputs[0].text == "slow" and eng.stats().structured_outputs["cache_hits"] == 1


def test_aborts_free_matchers_and_waiting_requests(monkeypatch):
    real = compiler.compile_matcher
    monkeypatch.setattr(compiler, "compile_matcher",
                        lambda p, t: (time.sleep(0.3) if p.regex == "wait" else None) or real(p, t))
    llm = LLM(str(STORIES_HF), num_kv_blocks=64)
    eng = llm.engine
    gc.collect()
    before = num_live_matchers()
    eng.add_request("waiting", "Tom", SamplingParams(structured_outputs=SO(regex="wait")))
    eng.add_request("running", "Tom", SamplingParams(n=3, seed=1, max_tokens=40,
                                                     structured_outputs=SO(regex="[a-z ]+")))
    for _ in range(4):
        eng.step()
    assert num_live_matchers() == before + 3 and "waiting" in eng.core.grammars
    eng.abort_request(["waiting", "running"])
    assert not eng.has_unfinished_requests() and len(eng.core.grammars) == 0 and not eng.core.groups
    gc.collect()
    assert num_live_matchers() == before
    eng.check_integrity()


def test_a_complete_grammar_wins_over_min_tokens_and_length_ends_the_impossible(llm):
    outs = llm.generate(["Tom", "Tom"], [
        SamplingParams(temperature=0, min_tokens=6, max_tokens=12, structured_outputs=SO(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=5, structured_outputs=SO(regex="a{40}"))])
    assert outs[0].outputs[0].text in ("yes", "no") and outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text == "a" * len(outs[1].outputs[0].token_ids)
    assert outs[1].outputs[0].finish_reason == "length"


def test_compile_metrics_and_cache_hits():
    llm = LLM(str(STORIES_HF), num_kv_blocks=64)
    so = SO(json={"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]})
    for _ in range(3):
        llm.generate(["Tom"], SamplingParams(max_tokens=16, structured_outputs=so))
    s = llm.engine.stats().structured_outputs
    assert (s["compiles"], s["cache_hits"], s["compile_errors"], s["timeouts"]) == (1, 2, 0, 0)
    assert s["compile_time_buckets"][-1] == (float("inf"), 1) and s["compile_time_sum"] > 0
    collector = _EngineStatsCollector("m")
    collector.snapshot = llm.engine.stats()
    fams = {f.name: f for f in collector.collect()}
    hist = fams["kvserve:grammar_compile_time_seconds"]
    assert hist.type == "histogram" and any(s.name.endswith("_count") and s.value == 1 for s in hist.samples)
    assert fams["kvserve:grammar_cache_hits"].samples[0].value == 2
    assert fams["kvserve:num_requests_waiting_for_grammar"].samples[0].value == 0


def test_a_spec_is_checked_once_in_a_worker_whether_it_passed_or_not(llm):
    from kvserve.structured.sandbox import sandbox_for

    box = sandbox_for(llm.engine.tokenizer, llm.engine.core.limits.vocab_size)
    so, bad = SO(regex="[0-9]{3} checked once"), SO(regex="(unclosed")
    check_structured_outputs(so, llm.engine)
    checks = box.stats()["checks"]
    check_structured_outputs(SamplingParams(structured_outputs=so), llm.engine)
    for _ in range(2):
        with pytest.raises(ValueError, match="unclosed group"):
            check_structured_outputs(bad, llm.engine)
    assert box.stats()["checks"] == checks + 1          # the bad one, once; the good one, cached
