"""The engine core speaks token ids and emits deltas (engine/core_io.py): each step's output holds
only that step's new tokens, so its size does not grow with the stream; stop strings are the
frontend's, which aborts the sequence in the core at once (its blocks free, nothing leaks)."""
from __future__ import annotations

import pickle

from kvserve import SamplingParams
from kvserve.config import EngineConfig
from kvserve.engine.core_io import EngineCoreOutput, EngineCoreRequest
from kvserve.engine.engine_core import EngineCore
from kvserve.frontend.llm_engine import LLMEngine
from tests.conftest import STORIES_HF


def test_each_step_carries_only_its_new_tokens_and_its_size_stays_flat():
    core = EngineCore(EngineConfig(model=str(STORIES_HF), block_size=4))
    params = SamplingParams(max_tokens=300, ignore_eos=True, logprobs=2, temperature=0.0)
    core.add_request(EngineCoreRequest("a", [1, 403, 261], params, 0.0))
    sizes, tokens = [], []
    while core.has_unfinished_requests():
        for out in core.step():
            assert isinstance(out, EngineCoreOutput) and out.request_id == "a"
            (d,) = out.seqs
            assert len(d.new_token_ids) == 1 and len(d.new_logprobs) == 1     # one decode token
            assert d.new_logprobs[0].token_id == d.new_token_ids[0]
            tokens += d.new_token_ids
            sizes.append(len(pickle.dumps(out)))
        core.check_integrity()
    assert len(tokens) == 300 and out.finished and out.seqs[0].finish_reason == "length"
    # What crosses to the frontend per step is flat in the output length (a cumulative output
    # would grow by a token and a logprob table every step).
    assert max(sizes[250:299]) <= max(sizes[1:50]) + 16


def test_the_core_never_sees_text():
    """Stop strings are not the core's: it runs a request with one to max_tokens."""
    core = EngineCore(EngineConfig(model=str(STORIES_HF)))
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0, stop=[","])
    core.add_request(EngineCoreRequest("a", [1, 403, 261], params, 0.0))
    n = 0
    while core.has_unfinished_requests():
        n += sum(len(d.new_token_ids) for out in core.step() for d in out.seqs)
    assert n == 20


def test_a_stop_string_aborts_the_sequence_in_the_core_at_once():
    eng = LLMEngine(EngineConfig(model=str(STORIES_HF), block_size=4))
    ref = eng.core
    free = ref.kv.num_free_blocks
    eng.add_request("s", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=200, stop=[","],
                                                           n=2, seed=0))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
        eng.check_integrity()
    final = outs[-1]
    assert final.finished and all(c.finish_reason == "stop" and c.stop_reason == "," for c in final.outputs)
    assert all(len(c.token_ids) < 200 for c in final.outputs)
    assert not ref.groups and ref.kv.num_free_blocks == free     # retired, every block back
