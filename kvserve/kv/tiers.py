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
- `DiskStore`: one file per block under a directory (`<dir>/<hh>/<hash hex>.kvb`), written by a
  background thread (temporary file, then an atomic rename), LRU by file time and bounded in
  bytes. It scans the directory at start, so a restarted server hits on what it served before.
- `RedisStore` (kv/redis_store.py): SET/GET/EXISTS on `kvserve:kv:<hash hex>` keys (pipelined),
  optionally with a TTL; capacity is the server's own `maxmemory` policy.

`parse_tier_specs` reads `kv_tiers` (`["cpu:4GiB", "disk:/path:20GiB", "redis://127.0.0.1:6379"]`).
No store decides anything: `kv/connector.py` chooses what to save where and what to load.
"""
from __future__ import annotations

import os
import queue
import re
import threading
from collections import OrderedDict

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '500MB' -> 500000000, '1024' -> 1024."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: write e.g. 4GiB, 500MB or a number of bytes.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class KVStore:
    """A key -> payload map. `write_through`: the connector saves every block it labels here
    (not only evicted ones): the disk (survives a restart) and Redis (shared) are written through."""

    kind = "store"
    write_through = False

    def __init__(self, name: str):
        self.name = name

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        raise NotImplementedError

    def get(self, key: bytes) -> bytes | None:
        raise NotImplementedError

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """Store the payloads; returns what had to leave to make room (to move down a tier)."""
        raise NotImplementedError

    def delete(self, key: bytes) -> None:
        raise NotImplementedError

    def usage(self) -> tuple[int, int]:
        """(blocks held, bytes held); (-1, -1) where the store cannot say cheaply."""
        return -1, -1

    def flush(self) -> None:
        """Wait for background writes."""

    def close(self) -> None:
        self.flush()


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


class _WrittenInBackground(KVStore):
    """A store whose writes a background thread runs from `_queue` (`_write_loop`; None stops it)."""

    def _start_writer(self, name: str) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name=name, daemon=True)
        self._writer.start()

    def flush(self):
        self._queue.join()

    def close(self):
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)


class DiskStore(_WrittenInBackground):
    """One file per block under `root`, written in the background, LRU by file time."""

    kind = "disk"
    write_through = True
    SUFFIX = ".kvb"

    def __init__(self, root: str, capacity: int, name: str | None = None):
        super().__init__(name or f"disk:{root}")
        self.root = os.path.abspath(root)
        self.capacity = capacity
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()    # key -> file size, oldest first
        self._pending: dict[bytes, bytes] = {}                   # queued, not yet on disk
        self.nbytes = 0
        self._scan()
        self._start_writer("kv-disk-writer")

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + self.SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous run left (a restart keeps its hits), oldest first."""
        found = []
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                if f.name.endswith(self.SUFFIX):
                    try:
                        st = f.stat()
                        found.append((st.st_mtime, bytes.fromhex(f.name[:-len(self.SUFFIX)]), st.st_size))
                    except (OSError, ValueError):
                        continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self.nbytes += size

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                with self._lock:
                    payload = self._pending.get(key)
                if payload is not None:
                    path = self._path(key)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
                    with open(tmp, "wb") as f:
                        f.write(payload)
                    with self._lock:
                        if self._pending.get(key) is payload:     # not evicted meanwhile
                            os.replace(tmp, path)
                            del self._pending[key]
                        else:
                            os.unlink(tmp)
            except OSError:
                with self._lock:                                   # a failed write is a miss later
                    self._forget(key)
            finally:
                self._queue.task_done()

    def _forget(self, key: bytes) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self.nbytes -= size
        self._pending.pop(key, None)

    def contains_many(self, keys):
        with self._lock:
            return [k in self._index for k in keys]

    def get(self, key):
        with self._lock:
            payload = self._pending.get(key)
            if payload is None and key in self._index:
                self._index.move_to_end(key)
        if payload is not None:
            return payload
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except OSError:
            with self._lock:
                self._forget(key)
            return None
        try:
            os.utime(self._path(key))          # LRU order survives a restart
        except OSError:
            pass
        return data

    def put_many(self, items):
        doomed = []
        with self._lock:
            for key, payload in items:
                if len(payload) > self.capacity or key in self._index:
                    continue
                self._index[key] = len(payload)
                self.nbytes += len(payload)
                self._pending[key] = payload
                self._queue.put(key)
                while self.nbytes > self.capacity:
                    old, _ = next(iter(self._index.items()))
                    self._forget(old)
                    doomed.append(old)
        for key in doomed:
            try:
                os.unlink(self._path(key))
            except OSError:
                pass
        return []

    def delete(self, key):
        with self._lock:
            self._forget(key)
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def usage(self):
        with self._lock:
            return len(self._index), self.nbytes


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
        return DiskStore(path, cap) if open_store else None
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
