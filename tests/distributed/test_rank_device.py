"""Tensor-parallel ranks on CUDA (kvserve/distributed/tensor_parallel.py, executor.py), the parts
a CPU can check: rank r takes device r and makes it current (torch.cuda.set_device) before
anything lands on a device; too few devices is a ValueError before any worker starts; step
messages travel with host tensors and land on the receiving rank's device."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.distributed.executor import TPWorkers
from kvserve.distributed.tensor_parallel import bind_rank_device, rank_device, to_device, to_host
from kvserve.attention.metadata import AttentionMetadata, PrefillChunk


def test_rank_device_is_the_local_cuda_device_of_the_rank():
    assert rank_device("cuda", 0, device_count=2) == torch.device("cuda", 0)
    assert rank_device("cuda", 1, device_count=2) == torch.device("cuda", 1)
    assert rank_device("cpu", 5) == torch.device("cpu")


def test_bind_rank_device_sets_the_current_device_on_cuda_only():
    calls = []
    assert bind_rank_device("cuda", 3, device_count=4, set_device=calls.append) == torch.device("cuda", 3)
    assert calls == [torch.device("cuda", 3)]
    assert bind_rank_device("cpu", 3, set_device=calls.append) == torch.device("cpu")
    assert calls == [torch.device("cuda", 3)]


def test_too_few_cuda_devices_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="lower tensor_parallel_size to at most 1"):
        rank_device("cuda", 1, device_count=1)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            TPWorkers(SimpleNamespace(model=SimpleNamespace(device="cuda")), size=2)


def test_step_messages_carry_host_tensors_and_land_on_the_rank_device():
    table = torch.tensor([3, 4])
    meta = AttentionMetadata(slot_mapping=torch.arange(5), num_decode_tokens=2,
                             decode_block_tables=torch.zeros(2, 3, dtype=torch.long),
                             decode_context_lens=torch.tensor([1, 2]),
                             prefills=[PrefillChunk(2, 3, 3, table)])
    msg = ("forward", torch.arange(5), torch.arange(5), meta, torch.tensor([1, 4]))
    sent = to_host(msg)
    assert sent[0] == "forward" and sent[1] is msg[1]        # CPU tensors go as they are
    got = to_device(sent, torch.device("meta"))               # a stand-in for a rank's CUDA device
    tensors = [got[1], got[2], got[4], got[3].slot_mapping, got[3].decode_block_tables,
               got[3].decode_context_lens, got[3].prefills[0].block_table]
    assert all(t.device.type == "meta" for t in tensors)
    assert got[3].num_decode_tokens == 2
    assert (got[3].prefills[0].q_start, got[3].prefills[0].q_len) == (2, 3)
    assert meta.prefills[0].block_table is table             # the driver's own message is unchanged
