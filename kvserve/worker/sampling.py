"""The step's sampling stage: one step's logits -> a ModelRunnerOutput (worker/output.py).

Which logits row is whose is decided here and only here: one row per sampling sequence in the
runner's order (k + 1 rows for a sequence verifying k drafts: spec_decode/decoder.py), samples
waiting to fork (n > 1) drawing from their first sample's row with their own generators, a
beam's top 2 * beam_width candidates, and the rows of prompt positions whose logprobs were
asked for. A constrained sequence's row (structured outputs) is masked first by the bitmask
the core computed from its grammar, in place (the step's logits are this stage's:
sample/grammar_mask.py): penalties, greedy, top-k/p and logprobs see only the tokens its
grammar allows. Failures stay with their sequence: a sampling error is retried row by row and
fails only the row that raises; a grammar that allows no token fails its sequence; a
prompt-logprob error fails its request alone.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.sample.grammar_mask import apply_grammar_bitmask
from kvserve.sample.metadata import SamplingTable
from kvserve.sample.sampler import Sampler, beam_candidates, prompt_entries
from kvserve.structured.matcher import NO_ALLOWED_TOKEN
from kvserve.worker.output import ModelRunnerOutput
from kvserve.worker.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, sampler: Sampler, spec=None):
        self.sampler = sampler
        # every live sequence's sampling parameters as arrays, written once when it joins
        # (the runner's update_states); a step gathers its sampling rows' entries
        self.table = SamplingTable(sampler.vocab_size, sampler.device)
        self.spec = spec                       # a SpecDecoder, when speculating
        # For tools that need whole distributions (`kvserve perplexity --kl-divergence`): called
        # as hook(request, first position, raw logits [r, V]) for every prompt-logprob chunk.
        self.prompt_logprobs_hook = None

    def __call__(self, logits: torch.Tensor, samplers: list, prompt_rows: list, so: SchedulerOutput,
                 states: dict) -> ModelRunnerOutput:
        """logits [rows, V]: the runner's sampling rows; samplers: their sequences' states
        (worker/request_state.py), in order; `so`: the step's SchedulerOutput (drafts, forks,
        grammar bitmasks); states: every live sequence's state, by id."""
        out = ModelRunnerOutput()
        if so.draft_tokens and self.spec is not None:
            logits, samplers = self.spec.verify(logits, samplers, so.draft_tokens, self.sampler.generator, out)
        rows, reqs = [], []
        for i, req in enumerate(samplers):
            if req.params.use_beam_search:
                out.beam_candidates[req.request_id] = beam_candidates(logits[i], req.params.beam_width)
                continue
            for r in [req] + [states[w] for w in so.fork_waiters.get(req.request_id, ())]:
                if r.request_id in so.grammar_errors:      # its grammar allows nothing: it does not sample
                    out.grammar_errors[r.request_id] = so.grammar_errors[r.request_id]
                    continue
                rows.append(i)
                reqs.append(r)
        if reqs:
            self._sample(logits, rows, reqs, so.grammar_bitmask, out)
        for req, first, row_logits in prompt_rows:
            try:
                if self.prompt_logprobs_hook is not None:
                    self.prompt_logprobs_hook(req, first, row_logits)
                out.prompt_logprobs[req.request_id] = prompt_entries(req, first, row_logits)
            except Exception as e:  # noqa: BLE001
                logger.exception("prompt logprobs failed for request %s", req.request_id)
                out.fail(req.request_id, e)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list, bitmasks: dict,
                out: ModelRunnerOutput) -> None:
        same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
        x = logits if same else logits[rows]              # [S, V]: one row per request, in order
        constrained = [j for j, r in enumerate(reqs) if r.request_id in bitmasks]
        if constrained:     # the grammar's mask first: every later stage sees only allowed tokens
            bitmask = np.stack([bitmasks[reqs[j].request_id] for j in constrained])     # [C, W]
            bad = {constrained[i] for i in apply_grammar_bitmask(x, constrained, bitmask)}
            for j in bad:
                out.grammar_errors[reqs[j].request_id] = NO_ALLOWED_TOKEN
            if bad:
                keep = [j for j in range(len(reqs)) if j not in bad]
                x, reqs = x[keep], [reqs[j] for j in keep]
                if not reqs:
                    return
        try:
            results = self.sampler(x, reqs, self.table.gather([r.request_id for r in reqs]))
        except Exception:   # noqa: BLE001 -- find the row that fails; the others go on
            logger.exception("sampling failed; retrying row by row")
            results = []
            for j, r in enumerate(reqs):
                try:
                    results += self.sampler(x[j:j + 1], [r])
                except Exception as e:  # noqa: BLE001
                    results.append(e)
        for r, res in zip(reqs, results):
            if isinstance(res, BaseException):
                out.fail(r.request_id, res)
            else:
                out.sampled[r.request_id] = [res]
