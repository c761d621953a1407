"""The model runner on stories260K: steps with requests leaving, coming back and reordered give
the logits of a fresh runner; the null block is never written or handed out; the KV connector is
called at the runner's named points (no patched methods); tensor-parallel ranks get each step
as data (the SchedulerOutput) and write the same KV cache."""
from __future__ import annotations

import pytest
import torch

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.kv.connector import KVConnector, TieredConnector
from kvserve.kv.manager import KVCacheManager, PendingKVOps
from kvserve.kv.tiers import CpuStore
from kvserve.attention.torch_paged import TorchPagedAttention
from kvserve.model.llama import LlamaModel
from kvserve.model.loaders.checkpoint import load_model_dir
from kvserve.worker.sequence import RunnerSequence as Seq
from kvserve.worker.model_runner import ModelRunner
from tests.conftest import STORIES_HF

BS = 4


@pytest.fixture(scope="module")
def model():
    cfg, weights, _ = load_model_dir(str(STORIES_HF))
    return LlamaModel(cfg, weights, TorchPagedAttention.for_model(cfg, BS), torch.device("cpu"), torch.float32)


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
    assert runner.input_batches[0].rows.num_rows == 1                 # only c's row is held
    assert all(b != NULL_BLOCK for t in kv.block_tables.values() for b in (x.block_id for x in t))
    for t in runner.kv_cache_tensors():                          # nothing ever wrote the null block
        assert t.shape[0] == 33 and not t[NULL_BLOCK].any()


class Recorder(KVConnector):
    def __init__(self):
        self.calls = []

    def save_blocks(self, runner, saves):
        self.calls.append(("save", [b for b, _, _ in saves], runner.kv_cache_tensors()[0][2].clone()))

    def load_blocks(self, runner, loads):
        self.calls.append(("load", [b for b, _ in loads], runner.kv_cache_tensors()[0][2].clone()))

    def after_forward(self, scheduled, seconds):
        self.calls.append(("forward", [s.request_id for s, _, _ in scheduled], seconds))


def test_the_connector_is_called_at_the_named_points(model):
    runner = ModelRunner(model, 8, BS)
    runner.kv_connector = rec = Recorder()
    run(runner, KVCacheManager(8, BS), [Seq("a", list(range(1, 9)))])
    assert [c[:2] for c in rec.calls] == [("forward", ["a"])] and rec.calls[0][2] > 0
    rec.calls.clear()
    runner.apply_kv_ops(PendingKVOps(copies=[(1, 2)], saves=[(2, b"h", True)], loads=[(3, b"")]))
    assert [c[:2] for c in rec.calls] == [("save", [2]), ("load", [3])]
    k0 = runner.kv_cache_tensors()[0]
    assert not torch.equal(rec.calls[0][2], k0[1])               # the save saw block 2 before the copy
    torch.testing.assert_close(rec.calls[1][2], k0[1])           # the load ran after it


def test_tiers_attach_without_patching_the_runner(model):
    runner = ModelRunner(model, 8, BS)
    conn = TieredConnector([CpuStore(1 << 20)], BS, "auto")
    conn.attach_runner(runner)
    assert runner.kv_connector is conn and "execute" not in vars(runner)
    assert conn.block_bytes == sum(t[0].nbytes for t in runner.kv_cache_tensors())
    run(runner, KVCacheManager(8, BS), [Seq("a", list(range(1, 25)))])
    assert conn.rule.prefill_throughput is not None              # after_forward timed the step


def test_tensor_parallel_ranks_receive_the_scheduler_output_as_data(model):
    """The driver sends each step's SchedulerOutput (no tensors: ints and lists); a rank that
    runs the same messages, packing its own inputs from its own copy of the sequences, writes
    the same KV cache as the driver."""
    import pickle

    from kvserve.distributed.executor import DriverRunner
    from kvserve.sample.params import SamplingParams
    from kvserve.worker.scheduler_output import CachedSequenceData, NewSequenceData, SchedulerOutput

    class Workers:
        def __init__(self):
            self.sent = []

        def broadcast(self, msg):
            self.sent.append(pickle.dumps(msg))      # what crosses to the ranks

    workers = Workers()
    driver, rank = DriverRunner(model, 8, BS, workers), ModelRunner(model, 8, BS)
    driver.init_sampling(model.cfg.vocab_size, 0)
    params = SamplingParams(temperature=0.0)
    first = SchedulerOutput(new_seqs=[NewSequenceData("a", [1, 2, 3, 4, 5], 5, params, None, None),
                                      NewSequenceData("b", [1], 1, params, None, None)],
                            cached_seqs=[CachedSequenceData("a", [], [], [1, 2]),
                                         CachedSequenceData("b", [], [], [3])],
                            scheduled=[("a", 5, 0), ("b", 1, 0)])
    out = driver.execute_model(first)
    ta, tb = out.sampled["a"][0].token_id, out.sampled["b"][0].token_id
    # a decode step sends no sequence data: the worker appended what it sampled
    out = driver.execute_model(SchedulerOutput(scheduled=[("a", 1, 5), ("b", 1, 1)]))
    assert driver.states["a"].token_ids == [1, 2, 3, 4, 5, ta, out.sampled["a"][0].token_id]
    assert driver.states["b"].token_ids[:2] == [1, tb] and driver.states["b"].block_ids == [3]
    driver.execute_model(SchedulerOutput(finished_seq_ids=["a", "b"]))       # the ranks forget them too
    assert not driver.states
    for msg in workers.sent:
        kind, sampled, so = pickle.loads(msg)
        assert kind == "step" and "torch" not in msg.decode("latin-1")    # data, no tensors
        for sid, tokens in sampled.items():                              # as run_worker applies them
            rank.states[sid].token_ids.extend(tokens)
        rank.execute_model(so, sample=False)
    assert not rank.states
    for mine, theirs in zip(driver.kv_cache_tensors(), rank.kv_cache_tensors()):
        torch.testing.assert_close(mine, theirs)
