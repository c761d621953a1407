"""Memory gauges for `GET /metrics`, read at scrape time (seed 004: "GPU memory use and KV cache
utilisation"; the KV-cache gauge is metrics.py's kvserve:kv_cache_usage_perc):

    kvserve:resident_memory_bytes       RSS of the server process and every process under it (the
                                        engine core runs in a child process), from /proc
    kvserve:cuda_memory_used_bytes      device memory in use, every process's (`nvidia-smi`'s
                                        memory.used: the engine's weights, KV pool and CUDA context)
    kvserve:cuda_memory_total_bytes     the device's capacity (the same source)

A gauge whose source is missing (no /proc, no CUDA) is left out; a scrape never fails because a
memory query did.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

from prometheus_client.core import GaugeMetricFamily


def process_tree_rss(pid: int | None = None, proc: str = "/proc") -> int | None:
    """Resident bytes of process `pid` (default: this one) and all its descendants, from /proc/*/stat
    (parent ids) and /proc/*/statm (resident pages). None without /proc."""
    pid = os.getpid() if pid is None else pid
    page = os.sysconf("SC_PAGE_SIZE")
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])   # fields after "(comm)": state, ppid
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"{proc}/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            if p == pid:
                return None
            continue
        todo.extend(children.get(p, []))
    return total


def cuda_memory() -> tuple[float, float] | None:
    """(used, total) bytes of device 0 as nvidia-smi sees them (the whole device, whichever process
    holds the memory); None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits",
                              "--id=0"], capture_output=True, text=True, timeout=2.0).stdout
        used, total = (float(x) * 2**20 for x in out.strip().splitlines()[0].split(","))   # MiB
        return used, total
    except Exception:   # noqa: BLE001
        return None


class MemoryCollector:
    """A Prometheus collector of the memory gauges; nvidia-smi is asked at most once a second."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._cuda: tuple[float, tuple | None] = (-1e9, None)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([self.model_name], float(value))
        return fam

    def collect(self):
        rss = process_tree_rss()
        if rss is not None:
            yield self._gauge("kvserve:resident_memory_bytes",
                              "Resident memory of the server and its engine processes.", rss)
        now = time.monotonic()
        if now - self._cuda[0] > 1.0:
            self._cuda = (now, cuda_memory())
        cuda = self._cuda[1]
        if cuda is not None:
            yield self._gauge("kvserve:cuda_memory_used_bytes", "CUDA device memory in use.", cuda[0])
            yield self._gauge("kvserve:cuda_memory_total_bytes", "CUDA device memory in total.", cuda[1])
