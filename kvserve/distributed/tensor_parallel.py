"""Tensor parallelism's process plumbing (seed 004's table: "splits a large model across
several GPUs"): which device each rank runs on.
How the model itself splits across ranks (Megatron-style heads, MLP and vocabulary slices, the
collectives) is kvserve/model/sharding.py; the executors that run the ranks are executor.py.

On CUDA rank r runs on device r (`bind_rank_device`: every rank is a process on this host, so
the global rank is the local one). What a step needs besides the weights travels as plain data
(the SchedulerOutput, block moves: ints and lists, no tensors) pickled over a gloo group, and
each rank builds its own tensors on its own device from it.
"""
from __future__ import annotations

import torch


def rank_device(device: torch.device | str, rank: int, device_count: int | None = None) -> torch.device:
    """The device tensor-parallel rank `rank` runs on: cuda:rank when the engine's device is
    CUDA (`device_count`: CUDA devices visible, torch's count when None), else the CPU."""
    if torch.device(device).type != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count() if device_count is None else device_count
    if rank >= count:
        raise ValueError(f"tensor-parallel rank {rank} needs CUDA device {rank}, but {count} are visible: "
                         f"lower tensor_parallel_size to at most {count} (or set CUDA_VISIBLE_DEVICES).")
    return torch.device("cuda", rank)


def bind_rank_device(device: torch.device | str, rank: int, device_count: int | None = None,
                     set_device=None) -> torch.device:
    """`rank_device`, made this process's current CUDA device (`torch.cuda.set_device`), so NCCL
    and every tensor created without a device index land on it."""
    d = rank_device(device, rank, device_count)
    if d.type == "cuda":
        (set_device or torch.cuda.set_device)(d)
    return d
