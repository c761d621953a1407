"""The model runner on stories260K: steps with requests leaving, coming back and reordered give
the logits of a fresh runner; the null block is never written or handed out; tensor-parallel
step messages carry values, not the persistent buffers."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.manager import KVCacheManager
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import load_model_dir
from kvserve.worker.model_runner import ModelRunner, make_attention_backend
from tests.conftest import STORIES_HF

BS = 4


@dataclass
class Seq:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@pytest.fixture(scope="module")
def model():
    cfg, weights, _ = load_model_dir(str(STORIES_HF))
    return LlamaModel(cfg, weights, make_attention_backend(cfg, BS), torch.device("cpu"), torch.float32)


def run(runner, kv, seqs, drafts=None):
    """One step over `seqs` (all their unknown tokens); returns {request id: last logits [V]}."""
    batch = []
    for s in seqs:
        assert kv.allocate_slots(s.request_id, s.num_tokens)
        batch.append((s, s.num_tokens - s.num_computed_tokens, kv.block_ids(s.request_id)))
    logits, samplers, _ = runner.execute(batch, None, drafts)
    out = {}
    for s, row in zip(samplers, logits):
        s.num_computed_tokens = s.num_tokens
        s.token_ids.append(int(row.argmax()))
        out[s.request_id] = row
    return out


def test_steps_with_leaving_returning_and_reordered_requests_equal_a_fresh_runner(model):
    runner, kv = ModelRunner(model, 32, BS), KVCacheManager(32, BS)
    a, b, c = Seq("a", list(range(1, 12))), Seq("b", list(range(20, 27))), Seq("c", [3, 4, 5])
    steps = [[a, b], [b, a], [b], [c, a, b], [a], [b, c, a], [c]]
    for step in steps:
        got = run(runner, kv, step)
        for s in step:                          # the same tokens, alone, in a fresh runner
            alone = ModelRunner(model, 32, BS)
            own = KVCacheManager(32, BS)
            ref = run(alone, own, [Seq(s.request_id, s.token_ids[:-1])])
            torch.testing.assert_close(got[s.request_id], ref[s.request_id], atol=1e-4, rtol=1e-4)
            assert int(ref[s.request_id].argmax()) == s.token_ids[-1]
    assert runner.input_batch.rows.num_rows == 1                 # only c's row is held
    assert all(b != NULL_BLOCK for t in kv.block_tables.values() for b in (x.block_id for x in t))
    for t in runner._pools(runner.kv_caches):                          # nothing ever wrote the null block
        assert t.shape[0] == 33 and not t[NULL_BLOCK].any()


def test_tensor_parallel_messages_carry_values_not_buffers(model):
    from kvserve.distributed.executor import TPDriverRunner

    class Workers:
        def __init__(self):
            self.sent = []

        def broadcast(self, msg):
            self.sent.append(msg)

    workers = Workers()
    runner = TPDriverRunner(model, 8, BS, workers)
    run(runner, KVCacheManager(8, BS), [Seq("a", list(range(1, 6))), Seq("b", [1])])
    (msg,) = workers.sent
    _, input_ids, positions, meta, logits_indices = msg
    tensors = [input_ids, positions, logits_indices, meta.slot_mapping] + [c.block_table for c in meta.prefills]
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in tensors)
    assert input_ids.tolist()[:1] == [1] and meta.num_decode_tokens == 1
