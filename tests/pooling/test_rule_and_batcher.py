"""The pooling rule read from a model's files, and the batcher's batching, on small stand-ins."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from kvserve.pooling.batcher import BatcherClosed, EmbeddingBatcher, QueueFull
from kvserve.pooling.rule import DECODER_RULE, PoolingRule, read_rule


def st_dir(tmp_path, pooling: dict | None, extra_modules=(), normalize=True):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    modules += [{"idx": 9, "name": "9", "path": p, "type": t} for p, t in extra_modules]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    return tmp_path


@pytest.mark.parametrize("key, mode", [("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
                                       ("pooling_mode_lasttoken", "last")])
def test_rule_from_sentence_transformers_modules(tmp_path, key, mode):
    assert read_rule(st_dir(tmp_path, {key: True, "pooling_mode_max_tokens": False})) == PoolingRule(mode, True)


def test_rule_without_normalize_and_decoder_default(tmp_path):
    assert read_rule(st_dir(tmp_path, {"pooling_mode_cls_token": True}, normalize=False)) == PoolingRule("cls", False)
    assert read_rule(tmp_path / "nothing-here") == DECODER_RULE == PoolingRule("last", True)
    assert read_rule(None) == DECODER_RULE


@pytest.mark.parametrize("pooling, extra, says", [
    ({"pooling_mode_max_tokens": True}, (), "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, (), "exactly one"),
    ({"pooling_mode_mean_tokens": True}, (("2_Dense", "sentence_transformers.models.Dense"),), "Dense"),
    (None, (), "no Pooling module"),
])
def test_rules_kvserve_cannot_reproduce_are_refused(tmp_path, pooling, extra, says):
    with pytest.raises(ValueError, match=says):
        read_rule(st_dir(tmp_path, pooling, extra))


def test_pool_reads_the_right_rows_of_a_packed_batch():
    lengths = [3, 1, 2]
    rows = torch.arange(6 * 2, dtype=torch.float32).view(6, 2)        # [T, hidden]
    last, cls, mean = PoolingRule("last", False), PoolingRule("cls", False), PoolingRule("mean", False)
    assert last.positions(lengths).tolist() == [2, 3, 5]
    assert cls.positions(lengths).tolist() == [0, 3, 4]
    assert torch.equal(last.pool(rows[last.positions(lengths)], lengths), rows[[2, 3, 5]])
    want = torch.stack([rows[0:3].mean(0), rows[3], rows[4:6].mean(0)])
    assert torch.allclose(mean.pool(rows[mean.positions(lengths)], lengths), want)
    normed = PoolingRule("mean", True).pool(rows, lengths)
    assert torch.allclose(normed.norm(dim=1), torch.ones(3))


class Recording:
    """A model whose embedding of a prompt is [sum, len]; it records each batch."""

    def __init__(self, fail_on: int | None = None, delay: float = 0.0):
        self.batches, self.fail_on, self.delay = [], fail_on, delay

    def embed(self, prompts):
        self.batches.append([list(p) for p in prompts])
        time.sleep(self.delay)
        if self.fail_on is not None and any(self.fail_on in p for p in prompts):
            raise RuntimeError("boom")
        return torch.tensor([[sum(p), len(p)] for p in prompts], dtype=torch.float32)


def test_batches_start_at_the_oldest_prompt_and_group_by_length_under_the_padded_token_budget():
    model = Recording()
    b = EmbeddingBatcher(model, max_batch_tokens=8, max_batch_seqs=3)
    jobs = [b.submit([[1] * 2, [2] * 3]), b.submit([[3] * 4]), b.submit([[4], [5], [6], [7]]), b.submit([[9] * 20])]
    b.start()                    # everything is queued before the worker looks: one pass takes it all
    results = [j.future.result(10) for j in jobs]
    b.close()
    # each batch: the oldest prompt left (2, then 3, then 4 tokens), with the queued prompts
    # nearest its length, shorter ones first, while the batch x its longest fits 8 tokens and
    # three prompts at most; a 20-token prompt runs alone
    assert [[len(p) for p in batch] for batch in model.batches] == [[1, 1, 2], [1, 3], [1, 4], [20]]
    assert [r.tolist() for r in results] == [[[2, 2], [6, 3]], [[12, 4]], [[4, 1], [5, 1], [6, 1], [7, 1]],
                                             [[180, 20]]]
    assert all(r.dtype == np.float32 for r in results)


def test_queue_bound_cancellation_failure_and_close():
    model = Recording(fail_on=99)
    stats = type("S", (), {"num_waiting": 0, "num_running": 0, "num_steps": 0, "prompt_tokens_total": 0,
                           "forward_time_total": 0.0, "step_time_total": 0.0})()
    b = EmbeddingBatcher(model, max_batch_tokens=1, max_batch_seqs=1, max_waiting=3, stats=stats)
    ok, cancelled, failing = b.submit([[1], [2]]), b.submit([[5]]), b.submit([[99], [7]])
    assert stats.num_waiting == 5
    with pytest.raises(QueueFull):
        b.submit([[8]])
    cancelled.cancel()
    b.start()
    assert ok.future.result(10).tolist() == [[1, 1], [2, 1]]
    with pytest.raises(RuntimeError, match="boom"):
        failing.future.result(10)
    deadline = time.monotonic() + 10
    while stats.num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [5] not in [p for batch in model.batches for p in batch]     # the cancelled job never ran
    assert [7] not in [p for batch in model.batches for p in batch]     # nor the failed job's rest
    assert (stats.num_waiting, stats.num_steps, stats.prompt_tokens_total) == (0, 2, 2)   # passes that ran
    after = b.submit([[4]])                 # the queue has room again, and the worker goes on
    assert after.future.result(10).tolist() == [[4, 1]]
    b.close()
    with pytest.raises(BatcherClosed):
        b.submit([[1]])


def test_close_fails_what_is_still_queued():
    model = Recording(delay=0.3)
    b = EmbeddingBatcher(model, max_batch_tokens=1, max_batch_seqs=1)
    b.start()
    first = b.submit([[1]])
    while not model.batches:
        time.sleep(0.005)
    queued = b.submit([[2]])
    threading.Thread(target=b.close).start()
    with pytest.raises(BatcherClosed):
        queued.future.result(10)
    with pytest.raises(BatcherClosed):
        first.future.result(10)        # failed at once, although its batch was running
