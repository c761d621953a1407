"""The runner's persistent input batch (kvserve/worker/input_batch.py): over random step
sequences (requests joining, leaving, growing, copied on write, rolled back, preempted), every
step's inputs equal those built from scratch; block-table rows are written incrementally, padded
with the null block, and the buffers are the same memory step after step."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import NULL_BLOCK
from kvserve.worker.sequence import RunnerSequence as Seq
from kvserve.worker.input_batch import BlockTableRows, InputBatch

BS = 4
CPU = torch.device("cpu")


def expected(scheduled, drafts):
    """The step's inputs built from scratch (decodes first), as the runner did before."""
    dec = [e for e in scheduled if e[1] == 1 or e[0].request_id in drafts]
    order = dec + [e for e in scheduled if e not in dec]
    ids, pos, slots, dec_tables = [], [], [], []
    for req, n, table in order:
        start = req.num_computed_tokens
        toks = req.token_ids + drafts.get(req.request_id, [])
        for p in range(start, start + n):
            ids.append(toks[p])
            pos.append(p)
            slots.append(table[p // BS] * BS + p % BS)
            if (req, n, table) in dec:
                dec_tables.append(table)
    return ids, pos, slots, dec_tables


step_ops = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "cow", "rollback", "preempt",
                                                                  "drafts", "leave"]),
                              st.integers(1, 9)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(step_ops, st.integers(1, 4))
def test_every_step_equals_inputs_built_from_scratch(ops, per_step):
    """Each step applies its ops, then schedules every live request (a request that leaves
    stops being scheduled; one that comes back starts over)."""
    batch = InputBatch(CPU, BS)
    seqs: dict[str, Seq] = {}
    tables: dict[str, list[int]] = {}
    fresh = iter(range(1, 10 ** 6))
    for at in range(0, len(ops), per_step):
        drafts = {}
        for who, op, n in ops[at:at + per_step]:
            rid = f"r{who}"
            s = seqs.setdefault(rid, Seq(rid, [100 + who]))
            t = tables.setdefault(rid, [])
            if op == "leave":
                del seqs[rid], tables[rid]
            elif op == "cow" and t:
                t[len(t) // 2] = next(fresh)                 # a shared block replaced by its copy
            elif op == "rollback" and s.num_computed_tokens > 1:
                s.num_computed_tokens //= 2
                del s.token_ids[s.num_computed_tokens + 1:]
                del t[-(-(s.num_computed_tokens + 1) // BS):]
            elif op == "preempt":
                s.num_computed_tokens, t[:] = 0, []
            elif op == "grow":
                s.token_ids += [7 * who + i for i in range(n)]
            elif op == "drafts" and s.num_computed_tokens == s.num_tokens - 1:
                drafts[rid] = [200 + i for i in range(n % 4)]
        scheduled = []
        for rid, s in seqs.items():
            t = tables[rid]
            new = s.num_tokens - s.num_computed_tokens + len(drafts.get(rid, ()))
            while len(t) * BS < s.num_computed_tokens + new:
                t.append(next(fresh))
            scheduled.append((s, new, list(t)))
        if not scheduled:
            continue
        step = batch.prepare(scheduled, {}, drafts)
        ids, pos, slots, dec_tables = expected(scheduled, drafts)
        assert step.input_ids.tolist() == ids
        assert step.positions.tolist() == pos
        assert step.meta.slot_mapping.tolist() == slots
        if dec_tables:
            width = -(-(max(pos[:len(dec_tables)]) + 1) // BS)     # the blocks the longest context needs
            assert step.meta.decode_block_tables.tolist() == [(t + [NULL_BLOCK] * width)[:width]
                                                               for t in dec_tables]
            assert step.meta.decode_context_lens.tolist() == [p + 1 for p in pos[:len(dec_tables)]]
        rows = batch.rows
        assert rows.num_rows == len(scheduled)               # rows of absent requests released
        for s, _, t in scheduled:
            row = rows.buf.np[rows.row_of[s.request_id]]
            assert row[:len(t)].tolist() == t and (row[len(t):] == NULL_BLOCK).all()
        for s, n, _ in scheduled:                           # the step ran: K/V computed
            s.num_computed_tokens = min(s.num_tokens, s.num_computed_tokens + n)
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(300 + len(s.token_ids))


def test_a_growing_table_writes_only_its_new_block_ids():
    rows = BlockTableRows(CPU)
    rows.update("a", [5, 9])
    rows.update("b", [3])
    assert rows.num_written_ids == 3
    rows.update("a", [5, 9])                     # unchanged: nothing written
    assert rows.num_written_ids == 3
    rows.update("a", [5, 9, 12])                 # grew by one block: one id written
    assert rows.num_written_ids == 4
    rows.update("a", [5, 14, 12])                # copy on write in the middle: the row rewritten
    assert rows.num_written_ids == 7
    rows.update("a", [5])                        # rolled back: the tail is null again
    assert rows.buf.np[rows.row_of["a"], :4].tolist() == [5, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK]
    rows.keep_only({"a"})                        # b leaves; a's row is still a's
    assert rows.num_rows == 1 and rows.buf.np[rows.row_of["a"], 0] == 5
    assert (rows.buf.np[1:] == NULL_BLOCK).all()


def test_a_removed_row_is_filled_by_the_last_row():
    rows = BlockTableRows(CPU, max_rows=2, max_blocks=2)
    for i, rid in enumerate("abc"):                  # grows past 2 rows
        rows.update(rid, [10 * (i + 1), 10 * (i + 1) + 1, 10 * (i + 1) + 2])   # and past 2 blocks
    rows.keep_only({"b", "c"})
    assert rows.row_of == {"c": 0, "b": 1}
    assert rows.buf.np[0, :3].tolist() == [30, 31, 32] and rows.buf.np[1, :3].tolist() == [20, 21, 22]
    before = rows.num_written_ids
    rows.update("c", [30, 31, 32, 33])               # the moved row kept its contents
    assert rows.num_written_ids == before + 1


def test_the_buffers_are_the_same_memory_step_after_step():
    batch = InputBatch(CPU, BS)
    a, b = Seq("a", list(range(10))), Seq("b", list(range(3)))
    first = batch.prepare([(a, 10, [1, 2, 3]), (b, 3, [4])], {}, {})
    ptrs = [first.input_ids.data_ptr(), first.positions.data_ptr(), first.meta.slot_mapping.data_ptr()]
    a.num_computed_tokens, b.num_computed_tokens = 10, 3
    a.token_ids.append(11)
    b.token_ids.append(12)
    second = batch.prepare([(b, 1, [4]), (a, 1, [1, 2, 3])], {}, {})
    assert [second.input_ids.data_ptr(), second.positions.data_ptr(),
            second.meta.slot_mapping.data_ptr()] == ptrs
    assert second.input_ids.tolist() == [12, 11] and second.positions.tolist() == [3, 10]
    assert np.array_equal(second.meta.decode_block_tables.numpy(), [[4, 0, 0], [1, 2, 3]])


def test_drafts_run_as_decode_rows_over_one_table():
    """A token and its k drafts: k + 1 decode rows, context lengths start + 1 .. start + k + 1,
    the table as wide as the last draft needs (here past the first block)."""
    batch = InputBatch(CPU, BS)
    a = Seq("a", [5, 6, 7, 8], num_computed_tokens=3)
    b = Seq("b", list(range(9)), num_computed_tokens=0)
    step = batch.prepare([(b, 9, [7, 8, 9]), (a, 3, [2, 6])], {}, {"a": [40, 41]})
    assert step.input_ids.tolist()[:3] == [8, 40, 41] and step.meta.num_decode_tokens == 3
    assert step.meta.decode_context_lens.tolist() == [4, 5, 6]
    assert step.meta.decode_block_tables.tolist() == [[2, 6]] * 3
    assert step.meta.slot_mapping.tolist()[:3] == [2 * BS + 3, 6 * BS, 6 * BS + 1]
    assert [(c.q_start, c.q_len, c.context_len) for c in step.meta.prefills] == [(3, 9, 9)]
    assert step.samplers == [a, b] and step.logits_indices.tolist() == [0, 1, 2, 11]
