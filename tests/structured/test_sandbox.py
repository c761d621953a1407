"""Grammar checks in worker processes (issue 36): the specs that crashed the server with SIGSEGV
inside llguidance are refused before the compiler (bounds.py) or cost one worker (sandbox.py);
a check past its deadline kills its worker; the deadline counts from when a worker takes the
check, not from when it queued; per-owner and queue bounds; grammars with no finite output are
refused at check time, and a matcher error while decoding is the request's `grammar_error`."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve import LLM, SamplingParams
from kvserve.model.tokenizers.tokenizer import HFTokenizer
from kvserve.structured import StructuredOutputsParams as SO, check_structured_outputs
from kvserve.structured.sandbox import GrammarBusy, GrammarRejected, GrammarSandbox
from kvserve.structured.compiler import JSON_OPTIONS, llg_vocab
from tests.conftest import STORIES_HF


def lark_chain(n: int) -> str:          # the chain that crashed: 2,700 rules, 33 KB
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "x"\n'


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def slow_gbnf(n: int = 900) -> str:     # GBNF -> Lark is Python: ~0.4 s here for 900 rules
    return "root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} | "{i}"\n' for i in range(n)) + f'r{n} ::= "x"\n'


def raw(fmt: str, text: str, kind: str = "grammar"):
    """A spec past the cheap bounds (what StructuredOutputsParams would refuse), for the sandbox."""
    return SimpleNamespace(key=(fmt, text, ""), kind=kind)


@pytest.fixture()
def box():
    tok = HFTokenizer(STORIES_HF)
    backend, size, eos = llg_vocab(tok)
    sandbox = GrammarSandbox(backend.to_str(), size, eos, JSON_OPTIONS, num_workers=1)
    yield sandbox
    sandbox.close()


@pytest.mark.parametrize("make, words", [
    (lambda: SO(grammar=lark_chain(2700)), "defines 2702 rules"),
    (lambda: SO(grammar=gbnf_chain(5000)), "defines 5002 rules"),
    (lambda: SO(json=ref_chain(1200)), "holds 1201 \\$refs"),
    (lambda: SO(grammar="start: %json " + json.dumps(ref_chain(3000))), "holds 3001 \\$refs"),
    (lambda: SO(json=json.loads('{"not": ' * 150 + "{}" + "}" * 150)), "nests 151 levels deep"),
], ids=["lark-chain", "gbnf-chain", "ref-chain", "lark-json-ref-chain", "deep"])
def test_the_specs_that_crashed_are_refused_before_any_compiler(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_a_crash_costs_one_worker_and_is_a_refusal(box):
    crash = raw("lark", lark_chain(2700))             # SIGSEGV in llguidance on an 8 MiB stack
    with pytest.raises(GrammarRejected, match=r"structured_outputs.grammar crashed the grammar compiler \(killed by SIGSEGV\)"):
        box.check(crash, 10.0, 4096)
    assert box.stats()["crashes"] == 1 and box.stats()["workers"] == 1     # replaced
    box.check(SO(regex="[a-z]+"), 10.0, 4096)                               # the new one serves
    with pytest.raises(GrammarRejected, match="crashed"):                   # the same spec: cached
        box.check(crash, 10.0, 4096)
    assert box.stats()["crashes"] == 1
    box.check(raw("lark", lark_chain(1500)), 10.0, 4096)   # a chain the worker's stack holds


def test_a_check_past_its_deadline_kills_its_worker_and_is_not_cached(box):
    box.check(SO(regex="warm"), 10.0, 4096)                  # the worker is up
    pid = box._all[0].proc.pid
    spec = SO(grammar=slow_gbnf())
    with pytest.raises(GrammarRejected, match="did not compile within max_grammar_compile_s=0.05 s"):
        box.check(spec, 0.05, 4096)
    assert box.stats()["check_timeouts"] == 1 and box._all[0].proc.pid != pid
    box.check(spec, 30.0, 4096)                              # with time enough, it passes


def test_the_deadline_counts_from_when_a_worker_takes_the_check(box):
    box.check(SO(regex="warm"), 10.0, 4096)
    slow = threading.Thread(target=box.check, args=(SO(grammar=slow_gbnf(990)), 30.0, 4096))
    slow.start()
    time.sleep(0.05)                  # the slow one holds the only worker; this one queues behind it
    t0 = time.monotonic()
    box.check(SO(regex="[0-9]{2} queued"), 0.1, 4096)
    slow.join()
    assert time.monotonic() - t0 > 0.1                     # it waited longer than its deadline


def test_per_owner_and_queue_bounds():
    tok = HFTokenizer(STORIES_HF)
    backend, size, eos = llg_vocab(tok)
    box = GrammarSandbox(backend.to_str(), size, eos, JSON_OPTIONS, num_workers=1, max_queued=3, per_owner=2)
    try:
        tickets = [box.admit(SO(regex=f"a{i}"), 4096, "alice") for i in range(2)]
        with pytest.raises(GrammarBusy, match="2 grammar compiles of yours") as e:
            box.admit(SO(regex="a2"), 4096, "alice")
        assert e.value.scope == "owner"
        tickets.append(box.admit(SO(regex="b0"), 4096, "bob"))
        with pytest.raises(GrammarBusy, match="queued") as e:
            box.admit(SO(regex="c0"), 4096, "carol")
        assert e.value.scope == "queue"
        for t in tickets:
            box.run(t, 10.0)
        box.check(SO(regex="a2"), 10.0, 4096, "alice")       # all done: room again
        assert box.admit(SO(regex="a0"), 4096, "alice") is None   # cached: takes no place
    finally:
        box.close()


@pytest.fixture(scope="module")
def llm():
    return LLM(str(STORIES_HF), num_kv_blocks=64)


@pytest.mark.parametrize("so, words", [
    (SO(grammar='start: a\na: "x" a\n'), "forces at least"),
    (SO(grammar='root ::= root "x"\n'), "admits no output at all"),
    (SO(json={"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}), "forces at least"),
    (SO(regex="[^\\s\\S]"), "admits no output at all"),
], ids=["lark-recursion", "gbnf-left-recursion", "json-required-recursion", "empty-regex"])
def test_a_grammar_with_no_finite_output_is_refused_at_add(llm, so, words):
    with pytest.raises(GrammarRejected, match=words):
        check_structured_outputs(so, llm.engine)
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request("nf", "Tom", SamplingParams(structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()


def test_a_matcher_error_while_decoding_is_the_requests_grammar_error(llm):
    # passes the check (a choice at the start), then forces "x" for ever once "a" is taken
    tok = llm.engine.tokenizer
    c_tokens = {i: -100 for t, i in tok._tok.get_vocab().items() if t.lstrip("\u2581").startswith("c")}
    so = SO(grammar='start: "a" b | "c"\nb: "x" b\n')
    outs = llm.generate(["Tom", "Lily"], [
        SamplingParams(max_tokens=10, temperature=0, logit_bias=c_tokens, structured_outputs=so),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])
    bad, free = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason == "error" and bad.error_code == "grammar_error"
    assert "Too many items" in bad.error and "<state>" not in bad.error
    assert free.finish_reason == "length" and free.error_code is None      # the other went on
    sched = llm.engine.core.scheduler
    assert sched.counters.num_grammar_errors >= 1 and sched.counters.num_failed == 0
    llm.engine.check_integrity()
