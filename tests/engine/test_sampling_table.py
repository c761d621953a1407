"""The worker's sampling table (sample/metadata.py): each sequence's parameters written once as
a row of arrays, gathered per step; the sampler reading them chooses what it chose from the
parameters themselves, and the table holds exactly the live sequences."""
from __future__ import annotations

import random

import numpy as np
import torch

from kvserve import LLM, SamplingParams
from kvserve.sample.metadata import COLUMNS, SamplingMetadata, SamplingTable
from kvserve.sample.sampler import Sampler, process_logits
from kvserve.worker.request_state import SequenceState
from tests.conftest import STORIES_HF

V = 64


def random_params(rng: random.Random) -> SamplingParams:
    kw = {}
    if rng.random() < 0.5:
        kw["temperature"] = rng.choice([0.0, 0.5, 1.0, 1.7])
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([-1, 0, 1, 5, V, V + 10])
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.3, 0.9, 1.0])
    if rng.random() < 0.3:
        kw["min_p"] = rng.choice([0.0, 0.1])
    if rng.random() < 0.2:
        kw["typical_p"] = 0.8
    if rng.random() < 0.3:
        kw["repetition_penalty"] = 1.3
    if rng.random() < 0.3:
        kw["frequency_penalty"] = 0.5
    if rng.random() < 0.2:
        kw["logit_bias"] = {3: 5.0}
    if rng.random() < 0.2:
        kw["allowed_token_ids"] = [1, 2, 3, 7]
    if rng.random() < 0.3:
        kw["min_tokens"] = 3
    if rng.random() < 0.4:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(1000)
    return SamplingParams(**kw)


def test_gathered_rows_equal_the_parameters_arrays_after_adds_and_removes():
    rng = random.Random(0)
    table = SamplingTable(V, "cpu", capacity=2)          # grows past its first capacity
    live: dict[str, SamplingParams] = {}
    for step in range(200):
        if live and rng.random() < 0.4:
            sid = rng.choice(sorted(live))
            table.remove(sid)
            del live[sid]
        else:
            sid = f"s{step}"
            live[sid] = random_params(rng)
            table.add(sid, live[sid])
        assert len(table) == len(live)
        ids = rng.sample(sorted(live), k=min(len(live), 5))
        got, want = table.gather(ids), SamplingMetadata.build([live[s] for s in ids], V)
        for name in ("temperature", "top_k", "top_p", "min_p", "typical_p"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert np.array_equal(got.logprobs, want.logprobs) and np.array_equal(got.greedy, want.greedy)
        for name in ("penalty_rows", "vocab_rows", "bias_rows", "min_tokens_rows", "random_rows"):
            assert getattr(got, name) == getattr(want, name), name
    assert set(COLUMNS) == set(table.cols)


def test_the_sampler_chooses_the_same_from_the_table_as_from_the_parameters():
    rng = random.Random(1)
    for trial in range(20):
        params = [random_params(rng) for _ in range(rng.randint(1, 9))]
        reqs = [SequenceState(f"r{i}", [1, 5, 9] + [rng.randrange(V) for _ in range(rng.randint(0, 4))], 3, p,
                              p.seed, 2) for i, p in enumerate(params)]
        table = SamplingTable(V, "cpu")
        for r in reqs:
            table.add(r.request_id, r.params)
        logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(trial)) * 2
        meta = table.gather([r.request_id for r in reqs])
        assert torch.equal(process_logits(logits, reqs, meta), process_logits(logits, reqs))
        a = Sampler(V, torch.device("cpu"), seed=trial)(logits, reqs, meta)
        for r in reqs:
            r.generator = None                               # the seeded draws start over
        b = Sampler(V, torch.device("cpu"), seed=trial)(logits, reqs)
        assert [(x.token_id, x.logprob, x.rank, x.top) for x in a] == [(x.token_id, x.logprob, x.rank, x.top) for x in b]


def test_the_workers_table_holds_exactly_the_live_sequences():
    llm = LLM(model=str(STORIES_HF), num_kv_blocks=64, block_size=4, seed=0)
    table = llm.engine.core.runner.sampling.table
    outs = llm.generate(["Once upon", "Tom had a"], [SamplingParams(max_tokens=5, temperature=0.0),
                                                    SamplingParams(max_tokens=7, n=3, temperature=0.9, seed=3,
                                                                   top_k=5)])
    assert [len(o.outputs) for o in outs] == [1, 3]
    # finished sequences leave the table when the core next names them (the next step)
    llm.generate(["Lily"], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(table) <= 1 and set(table.row_of) == set(llm.engine.core.runner.states)
