"""Speculative decoding in the engine step (issue 12; seed 003: "a sequence that verifies
gamma drafted tokens contributes gamma + 1 tokens to the step instead of one"; seed 004).

    SpecDecoder.propose   the scheduler names who may speculate and how far
                          (`Scheduler.spec_candidates`: plain n == 1 decodes, none when the
                          running batch exceeds disable_by_batch_size); the proposer guesses
    Scheduler.schedule    gives each a slot for its last token + k drafts, under the token budget
    ModelRunner.execute   one packed pass; logits at all k + 1 positions of those rows
    SpecDecoder.verify    greedy prefix match or rejection sampling (sample/rejection.py)
    Scheduler.update_from_output
                          appends the emitted run token by token (stops cut it), advances
                          num_computed_tokens over the accepted drafts only, labels full
                          verified blocks, and rolls back the rest (`KVCacheManager.rollback`)
    SpecDecoder.after_step
                          the proposer drops the state of sequences that left the running batch

Beam search and n > 1 requests never speculate (the scheduler leaves them out): their
sequences share blocks by copy on write, and speculating would write drafts into them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram import NgramProposer, Proposer
from kvserve.sample.rejection import verify

logger = logging.getLogger(__name__)


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters (engine.stats(), kvserve:spec_decode_* metrics)."""

    num_drafts: int = 0                  # sequences verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)   # [k]: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft: accepted + the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def make_proposer(cfg: SpeculativeConfig, target) -> Proposer:
    if cfg.method == "ngram":
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    from kvserve.spec_decode.draft import DraftModelProposer
    return DraftModelProposer(cfg, target)


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, target, proposer: Proposer | None = None):
        """target: a spec_decode.draft.DraftTarget, what a draft model needs of the target."""
        self.config = cfg
        self.vocab_size = target.vocab_size
        self.proposer = proposer or make_proposer(cfg, target)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * cfg.num_speculative_tokens)
        # sequence id -> (steps left to sit out, consecutive fully rejected drafts): a sequence
        # the proposer keeps guessing wrong (free text for n-gram lookup) stops costing k + 1 rows
        self._backoff: dict[str, tuple[int, int]] = {}

    @staticmethod
    def scheduler_kwargs(cfg: SpeculativeConfig | None) -> dict:
        """What the scheduler needs to decide who speculates: k and the load threshold."""
        if cfg is None:
            return {}
        return dict(num_speculative_tokens=cfg.num_speculative_tokens,
                    spec_disable_by_batch_size=cfg.disable_by_batch_size)

    def propose(self, scheduler) -> dict[str, list[int]]:
        """Drafts for this step: {sequence id: draft ids}, ids checked to be in the vocabulary."""
        self.proposer.release({r.request_id for r in scheduler.running})   # aborted since the last step
        cands = [(r, k) for r, k in scheduler.spec_candidates() if not self._sitting_out(r.request_id)]
        if not cands:
            return {}
        reqs = [r for r, _ in cands]
        ks = [k for _, k in cands]
        drafts = {}
        for r, k, d in zip(reqs, ks, self.proposer.propose(reqs, ks)):
            d = list(d[:k])
            bad = next((i for i, t in enumerate(d) if not 0 <= t < self.vocab_size), None)
            d = d if bad is None else d[:bad]
            if d:
                drafts[r.request_id] = d
        return drafts

    def verify(self, logits: torch.Tensor, samplers: list, draft_tokens: dict[str, list[int]],
               engine_gen: torch.Generator, out) -> tuple[torch.Tensor, list]:
        """logits [rows, V] in the runner's layout (one row per sampler, k + 1 for a sampler
        with drafts). Puts each speculating sequence's emitted run (or its failure) into `out`
        (a ModelRunnerOutput); returns the plain samplers' logits and samplers, for the normal
        sampler."""
        plain_rows, plain, spec_rows, spec = [], [], [], []
        row = 0
        for r in samplers:
            k = len(draft_tokens.get(r.request_id, ()))
            if k:
                spec.append(r)
                spec_rows.extend(range(row, row + k + 1))
            else:
                plain.append(r)
                plain_rows.append(row)
            row += k + 1
        if not spec:
            return logits, samplers
        spec_logits = logits[spec_rows]
        drafts = [draft_tokens[r.request_id] for r in spec]
        try:
            results = verify(spec_logits, spec, drafts, engine_gen)
        except Exception:  # noqa: BLE001 -- find the request that fails; the others go on
            logger.exception("speculative verification failed; retrying request by request")
            results, at = [], 0
            for r, d in zip(spec, drafts):
                try:
                    results += verify(spec_logits[at:at + len(d) + 1], [r], [d], engine_gen)
                except Exception as e:  # noqa: BLE001
                    results.append(e)
                at += len(d) + 1
        s = self.stats
        for r, d, res in zip(spec, drafts, results):
            if isinstance(res, BaseException):
                out.fail(r.request_id, res)
                continue
            out.sampled[r.request_id] = res.run
            out.num_accepted_drafts[r.request_id] = res.num_accepted
            self._note(r.request_id, res.num_accepted)
            s.num_drafts += 1
            s.num_draft_tokens += len(d)
            s.num_accepted_tokens += res.num_accepted
            s.accepted_per_pos += [0] * (len(d) - len(s.accepted_per_pos))
            for i in range(res.num_accepted):
                s.accepted_per_pos[i] += 1
        same = len(plain_rows) == row
        return (logits if same else logits[plain_rows]), plain

    def _sitting_out(self, rid: str) -> bool:
        left, misses = self._backoff.get(rid, (0, 0))
        if left:
            self._backoff[rid] = (left - 1, misses)
        return left > 0

    def _note(self, rid: str, accepted: int) -> None:
        """Exponential back-off of a sequence whose drafts are all rejected."""
        cap = self.config.max_backoff_steps
        if accepted or not cap:
            self._backoff.pop(rid, None)
            return
        misses = self._backoff.get(rid, (0, 0))[1] + 1
        self._backoff[rid] = (min(2 ** (misses - 1), cap), misses)

    def after_step(self, scheduler) -> None:
        """After update_from_output: the proposer forgets sequences that left the running batch."""
        running = {r.request_id for r in scheduler.running}
        self.proposer.release(running)
        for rid in [rid for rid in self._backoff if rid not in running]:
            del self._backoff[rid]

    def check_integrity(self, scheduler) -> None:
        """The proposer's own KV (a draft model's) is sound: refcounts and the free queue agree
        (it may still hold a sequence aborted since the last step: the next step releases it)."""
        kv = getattr(self.proposer, "kv", None)
        if kv is not None:
            kv.check_integrity()
            assert not kv.swapped_tables and not kv.cache_state, "the draft cache never swaps nor shares"
