"""The KV tier shared by several kvserve instances: a Redis server (seed 003, "Tiers of KV
storage": "shared storage or other servers' memory over the network"). Payloads and keys as in
kv/tiers.py; written through by a background thread in pipelined batches."""
from __future__ import annotations

import threading

from kvserve.kv.tier_store import WrittenInBackground


class RedisStore(WrittenInBackground):
    """Blocks in a Redis server shared by several kvserve instances (written through, by a
    background thread in pipelined batches; reads see the queued writes at once)."""

    kind = "redis"
    write_through = True
    PREFIX = b"kvserve:kv:"

    def __init__(self, url: str, ttl_s: int | None = None, name: str | None = None):
        import redis   # the `redis` package: pip install redis

        super().__init__(name or url)
        self.url = url
        self.ttl_s = ttl_s
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One quick retry, no backoff: an unreachable store is a miss (kv/connector.py skips it a while)
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2,
                                           retry=Retry(NoBackoff(), 1))
        self._lock = threading.Lock()
        self._pending: dict[bytes, bytes] = {}
        self._start_writer("kv-redis-writer")

    def _k(self, key: bytes) -> bytes:
        return self.PREFIX + key.hex().encode()

    def _write_loop(self) -> None:
        while True:
            keys, items = self._queue.get(), []
            try:
                if keys is None:
                    return
                with self._lock:
                    items = [(k, self._pending[k]) for k in keys if k in self._pending]
                pipe = self.client.pipeline(transaction=False)
                for key, payload in items:
                    pipe.set(self._k(key), payload, ex=self.ttl_s)
                pipe.execute()
            except Exception:  # noqa: BLE001 -- a failed write is a miss later, never an error
                pass
            finally:
                with self._lock:
                    for k, p in items:
                        if self._pending.get(k) is p:
                            del self._pending[k]
                self._queue.task_done()

    def contains_many(self, keys):
        if not keys:
            return []
        with self._lock:
            local = [k in self._pending for k in keys]
        remote = [k for k, here in zip(keys, local) if not here]
        found = iter([])
        if remote:
            pipe = self.client.pipeline(transaction=False)
            for k in remote:
                pipe.exists(self._k(k))
            found = iter([bool(x) for x in pipe.execute()])
        return [True if here else next(found) for here in local]

    def get(self, key):
        return self.get_many([key])[0]

    def get_many(self, keys):
        if not keys:
            return []
        with self._lock:
            out = [self._pending.get(k) for k in keys]
        missing = [i for i, p in enumerate(out) if p is None]
        if missing:
            for i, p in zip(missing, self.client.mget([self._k(keys[i]) for i in missing])):
                out[i] = p
        return out

    def put_many(self, items):
        if items:
            with self._lock:
                for key, payload in items:
                    self._pending[key] = payload
            self._queue.put([k for k, _ in items])
        return []

    def delete(self, key):
        with self._lock:
            self._pending.pop(key, None)
        self.client.delete(self._k(key))

    def close(self):
        super().close()
        self.client.close()
