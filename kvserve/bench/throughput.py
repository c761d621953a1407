"""Offline throughput: N requests with random prompt and output lengths, all submitted at once,
run to completion through the engine; reports output tokens/s, TTFT/TPOT and engine overhead."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvserve.sample.params import SamplingParams


@dataclass
class ThroughputResult:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    steps: int
    forward_s: float
    step_s: float

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def overhead_share(self) -> float:
        """Share of engine step time spent outside the forward pass."""
        return 1.0 - self.forward_s / self.step_s if self.step_s else 0.0


def mixed_workload(num_requests: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs, lengths uniform in the given ranges."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        work.append(([rng.randrange(3, vocab_size) for _ in range(n_in)], n_out))
    return work


def run_engine(engine, work: list[tuple[list[int], int]]) -> ThroughputResult:
    """Submit every request at once (greedy, ignore_eos) and step until all finish."""
    before = engine.stats()
    t0 = time.perf_counter()
    for i, (ids, n_out) in enumerate(work):
        engine.add_request(f"bench-{i}-{t0}", {"prompt_token_ids": ids},
                           SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    return ThroughputResult(len(work), sum(len(ids) for ids, _ in work), out_tokens, elapsed,
                            after.num_steps - before.num_steps,
                            after.forward_time_total - before.forward_time_total,
                            after.step_time_total - before.step_time_total)
