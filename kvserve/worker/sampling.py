"""The step's sampling stage: one step's logits -> a ModelRunnerOutput (worker/output.py).

Which logits row is whose is decided here and only here: one row per sampling sequence in the
runner's order (k + 1 rows for a sequence verifying k drafts: spec_decode/decoder.py), samples
waiting to fork (n > 1) drawing from their first sample's row with their own generators, a
beam's top 2 * beam_width candidates, and the rows of prompt positions whose logprobs were
asked for. A constrained sequence's row (structured outputs) is masked by its grammar first,
in place (the step's logits are this stage's): penalties, greedy, top-k/p and logprobs see only
the tokens its grammar allows. Failures stay with their sequence: a sampling error is retried
row by row and fails only the row that raises; a grammar that allows no token fails its
sequence; a prompt-logprob error fails its request alone.
"""
from __future__ import annotations

import logging

import torch

from kvserve.sample.sampler import Sampled, Sampler, token_logprobs
from kvserve.structured.matcher import mask_logits
from kvserve.worker.output import ModelRunnerOutput

logger = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, sampler: Sampler, spec=None):
        self.sampler = sampler
        self.spec = spec                       # a SpecDecoder, when speculating
        # For tools that need whole distributions (`kvserve perplexity --kl-divergence`): called
        # as hook(request, first position, raw logits [r, V]) for every prompt-logprob chunk.
        self.prompt_logprobs_hook = None

    def __call__(self, logits: torch.Tensor, samplers: list, prompt_rows: list,
                 draft_tokens: dict[str, list[int]], fork_waiters: dict[str, list]) -> ModelRunnerOutput:
        """logits [rows, V]: the runner's sampling rows; samplers: their sequences, in order."""
        out = ModelRunnerOutput()
        if draft_tokens and self.spec is not None:
            logits, samplers = self.spec.verify(logits, samplers, draft_tokens, self.sampler.generator, out)
        rows, reqs = [], []
        for i, req in enumerate(samplers):
            if req.params.use_beam_search:
                out.beam_candidates[req.request_id] = beam_candidates(logits[i], req.params.beam_width)
                continue
            for r in [req] + fork_waiters.get(req.request_id, []):
                rows.append(i)
                reqs.append(r)
        if reqs:
            self._sample(logits, rows, reqs, out)
        for req, first, row_logits in prompt_rows:
            try:
                if self.prompt_logprobs_hook is not None:
                    self.prompt_logprobs_hook(req, first, row_logits)
                out.prompt_logprobs[req.request_id] = prompt_entries(req, first, row_logits)
            except Exception as e:  # noqa: BLE001
                logger.exception("prompt logprobs failed for request %s", req.request_id)
                out.fail(req.request_id, e)
        return out

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list, out: ModelRunnerOutput) -> None:
        same = len(rows) == logits.shape[0] and rows == list(range(len(rows)))
        x = logits if same else logits[rows]              # [S, V]: one row per request, in order
        constrained = [j for j, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
        if constrained:     # the grammar's mask first: every later stage sees only allowed tokens
            bad = mask_logits(x, constrained, [reqs[j].grammar for j in constrained])
            for j, why in bad.items():
                out.grammar_errors[reqs[j].request_id] = why
            if bad:
                keep = [j for j in range(len(reqs)) if j not in bad]
                x, reqs = x[keep], [reqs[j] for j in keep]
                if not reqs:
                    return
        try:
            results = self.sampler(x, reqs)
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


def beam_candidates(row: torch.Tensor, width: int) -> tuple[list[int], list[float]]:
    """A beam's top 2 * width (token ids, raw logprobs), best first."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top_lp, top_ids = lp.topk(min(2 * width, lp.shape[-1]))
    return top_ids.tolist(), top_lp.tolist()


@torch.inference_mode()
def prompt_entries(req, first: int, logits: torch.Tensor) -> list[Sampled]:
    """The entries of prompt tokens first + 1 .. first + r from `logits` [r, V], the raw rows
    at positions first .. first + r - 1: the token's logprob (log_softmax, the raw model
    distribution, like the sampler's) and rank, and the top `prompt_logprobs` tokens."""
    assert first + 1 == req.num_prompt_logprobs, \
        f"{req}: prompt entries {req.num_prompt_logprobs}, rows from position {first}"
    r = logits.shape[0]
    targets = req.prompt_token_ids[first + 1:first + 1 + r]
    chosen, ranks, top_ids, top_lps = token_logprobs(
        logits, torch.tensor(targets, dtype=torch.long, device=logits.device), req.params.prompt_logprobs)
    return [Sampled(tid, c, rank, list(zip(ids, lps)))
            for tid, c, rank, ids, lps in zip(targets, chosen, ranks, top_ids, top_lps)]
