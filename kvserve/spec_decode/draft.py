"""The draft-model proposer (seed 004: "a small model guesses, the large one checks"):
any model kvserve loads (HF, llama2.c, GGUF) with the target's vocabulary, or the target's own
weights quantized ("self-int8", "self-int4": no second model, a fraction of the bytes; "self":
the target itself, for tests), with its own paged KV cache in the same engine.

Per engine step, over all speculating sequences at once: one packed pass catches each draft
sequence up with the target's tokens (the prompt on first sight, then the one or two tokens of
the last verified run) and gives draft 1; then k - 1 one-token passes give the rest. Drafts
are the draft model's argmax (a point-mass proposal: sample/rejection.py's rejection sampling
needs no draft probabilities).

Rollback, the same way as the target's: the draft's K/V are valid for the longest common
prefix of the tokens it ran and the sequence's tokens now; `num_computed_tokens` rewinds to
it and blocks past it go back to the draft pool (`KVCacheManager.rollback`). A sequence that
leaves the running batch (finished, preempted, swapped) drops its draft cache (`release`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvserve.config.resolved import ModelLoadConfig

from kvserve.kv.manager import KVCacheManager
from kvserve.model.loaders.checkpoint import read_model_config
from kvserve.spec_decode.config import SELF_DRAFTS, SpeculativeConfig
from kvserve.spec_decode.ngram import Proposer
from kvserve.worker.build import build_model
from kvserve.worker.device import torch_dtype
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.sequence import RunnerSequence

PROBE = "The quick brown fox jumps over the lazy dog. 1234 \u00e9t\u00e9"


def draft_footprint(r, target_cfg) -> tuple[int, int]:
    """(bytes of one KV block, bytes of float weights) of the draft model `r.speculative` names
    (`r`: the resolved Config), from its config alone (a "self" draft has `target_cfg`'s shape);
    (0, 0) without one. kv_sizing budgets the draft's pool with the target's from these, before
    either is built."""
    spec = r.speculative
    if spec is None or spec.method != "draft_model":
        return 0, 0
    m = target_cfg if spec.model in SELF_DRAFTS else read_model_config(spec.model)
    E, D = m.hidden_size, m.head_dim
    params = (m.vocab_size * E * (1 if m.tie_word_embeddings else 2)
              + m.num_layers * 2 * E * (m.num_heads + m.num_kv_heads) * D + m.mlp_params())
    dtype = torch_dtype(r.model.dtype)
    return (ModelRunner.kv_bytes_per_block(m, r.cache.block_size, dtype),
            params * torch.empty((), dtype=dtype).element_size())


def _common_prefix(a: list[int], b: list[int], n: int) -> int:
    n = min(n, len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class DraftTarget:
    """What a draft model needs of the target it drafts for (the engine builds it)."""

    load: ModelLoadConfig            # the target's resolved load section (dtype, device, quantization)
    attention_backend: str           # as the user asked ("auto": decided for the draft's own heads)
    block_size: int
    num_blocks: int                  # the draft's pool has as many blocks (kv_sizing budgets both)
    vocab_size: int
    tokenizer: object                # the target's, or None


class DraftModelProposer(Proposer):
    def __init__(self, cfg: SpeculativeConfig, target: DraftTarget):
        t = target.load
        path, quant = cfg.model, cfg.quantization
        if path in SELF_DRAFTS:
            path, quant = t.model, quant or SELF_DRAFTS[path]
        # the target's dtype; a GGUF draft runs in its own types unless a quantization asks otherwise
        load = dataclasses.replace(
            t, model=path, quantization=quant, quantize_activations=False,
            attention_backend=target.attention_backend,
            quantization_group_size=t.quantization_group_size if quant == t.quantization else None)
        bs = target.block_size
        built = build_model(load, bs, "auto", t.device)
        model_cfg, tok = built.config, built.tokenizer
        if model_cfg.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {cfg.model!r} has a vocabulary of {model_cfg.vocab_size} "
                             f"tokens, the target {target.vocab_size}: a draft must share the target's "
                             "tokenizer.")
        if tok is not None and target.tokenizer is not None and tok.encode(PROBE) != target.tokenizer.encode(PROBE):
            raise ValueError(f"the draft model {cfg.model!r} tokenizes text differently from the target: "
                             "a draft must share the target's tokenizer.")
        self.model = built.model
        self.max_positions = model_cfg.max_position_embeddings
        num_blocks = target.num_blocks
        self.kv = KVCacheManager(num_blocks, bs)           # no prefix cache: draft K/V are private
        self.runner = ModelRunner(self.model, num_blocks, bs)
        self.seqs: dict[str, RunnerSequence] = {}

    def release(self, live_ids: set[str]) -> None:
        for rid in [r for r in self.seqs if r not in live_ids]:
            del self.seqs[rid]
            self.kv.free(rid)

    def propose(self, requests, num_drafts):
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        active: dict[str, int] = {}
        for req, k in zip(requests, num_drafts):
            rid = req.request_id
            s = self.seqs.get(rid)
            if s is None:
                s = self.seqs[rid] = RunnerSequence(rid)
            # rollback: keep the K/V of the longest prefix the draft ran that is still the
            # sequence's, less its last token (run again: its logits give draft 1)
            s.num_computed_tokens = _common_prefix(s.token_ids, req.token_ids,
                                                   min(s.num_computed_tokens, req.num_tokens - 1))
            self.kv.rollback(rid, s.num_computed_tokens)
            s.token_ids = list(req.token_ids)
            k = min(k, self.max_positions - s.num_tokens + 1)
            # positions run: [num_computed, num_tokens + k - 1): the k-th draft is never run
            if k > 0 and self.kv.allocate_slots(rid, s.num_tokens + k - 1):
                active[rid] = k
        while active:
            batch = [(self.seqs[rid], self.seqs[rid].num_tokens - self.seqs[rid].num_computed_tokens,
                      self.kv.block_ids(rid)) for rid in active]
            logits, samplers, _ = self.runner.execute(batch)                 # [S, V]
            for s, t in zip(samplers, logits.argmax(dim=-1).tolist()):
                s.num_computed_tokens = s.num_tokens
                s.token_ids.append(t)
                drafts[s.request_id].append(t)
            active = {rid: k for rid, k in active.items() if len(drafts[rid]) < k}
        return [drafts[r.request_id] for r in requests]
