"""Tensor-parallel ranks on CUDA (kvserve/distributed/tensor_parallel.py, executor.py), the parts
a CPU can check: rank r takes device r and makes it current (torch.cuda.set_device) before
anything lands on a device; too few devices is a ValueError before any worker starts (step
messages are data: tests/worker/test_model_runner.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.distributed.executor import Workers
from kvserve.distributed.tensor_parallel import bind_rank_device, rank_device


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
            Workers(SimpleNamespace(model=SimpleNamespace(device="cuda")), size=2)
