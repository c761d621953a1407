"""The interface of a KV tier store (kv/tiers.py): a key -> payload map, and the base of the
stores whose writes a background thread runs (kv/disk_store.py, kv/redis_store.py). Its own
module so that the stores and `parse_tier_spec`, which opens them, need not import each other."""
from __future__ import annotations

import queue
import threading


class KVStore:
    """A key -> payload map. `write_through`: the connector saves every block it labels here
    (not only evicted ones): the disk (survives a restart) and Redis (shared) are written through."""

    kind = "store"
    write_through = False
    saves = True          # the connector saves blocks here (a KV stream's inbox is read-only)
    always_reload = False   # loading always beats recomputing (no reload-rule check)
    verified = False      # payloads were checksummed on the way in (not again at load)
    failures = 0          # writes the store itself saw fail (the disk's background writer)
    bytes_refused = 0     # payload bytes it did not store because of them, or of a full disk

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


class WrittenInBackground(KVStore):
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
