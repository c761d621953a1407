"""Tensor parallelism's process plumbing (seed 004's table: "splits a large model across
several GPUs"): which device each rank runs on, and the host copies of what the driver sends.
How the model itself splits across ranks (Megatron-style heads, MLP and vocabulary slices, the
collectives) is kvserve/model/sharding.py; the executors that run the ranks are executor.py.

On CUDA rank r runs on device r (`bind_rank_device`: every rank is a process on this host, so
the global rank is the local one). What a step needs besides the weights (token ids, positions,
attention metadata, block moves) travels from the host: the driver sends CPU copies as pickled
objects over a gloo group (`to_host`), each rank moves them to its device (`to_device`), so no
rank deserializes another rank's CUDA tensors.
"""
from __future__ import annotations

import dataclasses

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


def map_tensors(obj, fn):
    """`obj` with every tensor inside it (tuples, lists, dicts, dataclasses) replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: map_tensors(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_host(msg):
    """A message for the workers with its tensors on the CPU (a no-op for CPU tensors)."""
    return map_tensors(msg, lambda t: t.cpu())


def to_device(msg, device: torch.device):
    """A received message with its tensors on this rank's `device`."""
    return map_tensors(msg, lambda t: t.to(device, non_blocking=True))
