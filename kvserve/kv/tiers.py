"""Stores below the device pool (seed 003, "Tiers of KV storage"): CPU memory, local disk, and a
Redis server shared by several kvserve instances.

"A GPU's memory is a small, fast cache for a much larger body of reusable KV. Below it sits the
CPU memory of the same server ..., then local SSDs ..., then shared storage or other servers'
memory over the network." Each store here is a plain key -> bytes map of *block payloads*
(kv/connector.py packs them: the K/V of every layer for one full block, a header and a
checksum), keyed by the block's chained SHA-256 hash (kv/prefix_cache.py). The hash already
holds the model namespace and the request's `cache_salt`, so a store shared between tenants
or instances never serves one salt's KV to another.

- `CpuStore`: an LRU of payloads in process memory, bounded in bytes; what falls off its end is
  handed back so the connector can move it down to the next tier ("evicted blocks move down").
- `DiskStore` (kv/disk_store.py): one file per block under a directory, written by a background
  thread, LRU by file time and bounded in bytes; it survives restarts and full disks.
- `RedisStore` (kv/redis_store.py): SET/GET/EXISTS on `kvserve:kv:<hash hex>` keys (pipelined),
  optionally with a TTL; capacity is the server's own `maxmemory` policy.

`parse_tier_specs` reads `kv_tiers` (`["cpu:4GiB", "disk:/path:20GiB", "redis://127.0.0.1:6379"]`).
The stores' interface is `KVStore` (kv/tier_store.py). No store decides anything:
`kv/connector.py` chooses what to save where and what to load.
"""
from __future__ import annotations

import re
from collections import OrderedDict

from kvserve.kv.tier_store import KVStore

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '500MB' -> 500000000, '1024' -> 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 4GiB, 500MB or a number of bytes.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class CpuStore(KVStore):
    """LRU of payloads in CPU memory, at most `capacity` bytes (plain bytes objects; a CUDA
    build would keep pinned buffers here for faster host-to-device copies)."""

    kind = "cpu"

    def __init__(self, capacity: int, name: str = "cpu"):
        super().__init__(name)
        self.capacity = capacity
        self.nbytes = 0
        self._lru: OrderedDict[bytes, bytes] = OrderedDict()

    def contains_many(self, keys):
        return [k in self._lru for k in keys]

    def get(self, key):
        payload = self._lru.get(key)
        if payload is not None:
            self._lru.move_to_end(key)
        return payload

    def put_many(self, items):
        out = []
        for key, payload in items:
            if len(payload) > self.capacity:
                continue
            old = self._lru.pop(key, None)
            if old is not None:
                self.nbytes -= len(old)
            self._lru[key] = payload
            self.nbytes += len(payload)
            while self.nbytes > self.capacity:
                k, p = self._lru.popitem(last=False)
                self.nbytes -= len(p)
                out.append((k, p))
        return out

    def delete(self, key):
        p = self._lru.pop(key, None)
        if p is not None:
            self.nbytes -= len(p)

    def usage(self):
        return len(self._lru), self.nbytes


def parse_tier_spec(spec: str, open_store: bool = True) -> KVStore | None:
    """'cpu:4GiB' | 'disk:/path[:20GiB]' | 'redis://host:port[/db][?ttl=3600]'. With
    open_store=False only the syntax is checked (config time) and None is returned."""
    s = spec.strip()
    if s.startswith("cpu:"):
        cap = parse_size(s[4:])
        return CpuStore(cap) if open_store else None
    if s.startswith("disk:"):
        rest = s[5:]
        path, cap = rest, 10 * 2**30
        if ":" in rest:
            head, tail = rest.rsplit(":", 1)
            try:
                cap, path = parse_size(tail), head
            except ValueError:
                pass
        if not path:
            raise ValueError(f"kv tier {spec!r} names no directory: write disk:/path:20GiB.")
        if not open_store:
            return None
        from kvserve.kv.disk_store import DiskStore
        return DiskStore(path, cap)
    if s.startswith(("redis://", "rediss://", "unix://")):
        url, ttl = s, None
        m = re.search(r"[?&]ttl=(\d+)", s)
        if m:
            ttl = int(m.group(1))
            url = re.sub(r"[?&]ttl=\d+", "", s)
        if not open_store:
            return None
        from kvserve.kv.redis_store import RedisStore
        return RedisStore(url, ttl)
    raise ValueError(f"unknown kv tier {spec!r}: use cpu:SIZE, disk:/path:SIZE or redis://host:port.")


def split_tier_specs(kv_tiers) -> list[str]:
    """kv_tiers as given (None, 'cpu:1GiB,disk:/x:2GiB' or a list) -> a list of specs."""
    if not kv_tiers:
        return []
    if isinstance(kv_tiers, str):
        return [s for s in (p.strip() for p in kv_tiers.split(",")) if s]
    return [str(s) for s in kv_tiers]
