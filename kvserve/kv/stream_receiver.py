"""The decode instance's side of layer-wise KV streaming (kv/stream_wire.py; seed 000: "only
the transfer of the last layer delays the decode").

`KVStreamReceiver` listens on a TCP port. The proxy reserves room for a prompt's KV under a
transfer id before the prefill starts (a full receiver refuses: backpressure before any work is
done); the prefill instance then opens the transfer and sends each layer's part of each full
prompt block as that layer is written. A block whose every layer has landed waits in the
`StreamInbox` until DONE, when the transfer is complete and its blocks become a KV tier that
the decode request's admission loads like any tier hit (kv/connector.py): same store keys,
same checksummed payloads, so a block that did not arrive, or arrived for other weights, is
simply a miss the decode instance recomputes.

Bounded memory: reservations and held bytes together never pass `capacity` bytes; a transfer
that would (its prompt was longer than reserved and the buffer is full) fails. A transfer that
fails -- refused layout, connection lost, no frame for `timeout_s`, overflow -- frees its bytes
at once and its request recomputes the prompt (`EngineCore`'s remote-KV wait list counts why).
Transfers nobody claims within `timeout_s` of their last event are dropped.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvserve.kv.block_io import BlockAssembly
from kvserve.kv.stream_wire import (ABORT, CANCEL, DONE, LAYER, OPEN, REPLY, RESERVE, WireError, json_frame,
                                    parse_layer, read_frame)
from kvserve.kv.tier_store import KVStore

logger = logging.getLogger(__name__)

PENDING, COMPLETE, FAILED = "pending", "complete", "failed"


class StreamInbox(KVStore):
    """Streamed blocks of complete transfers, as a read-only KV tier: key -> payload, counted by
    the transfers holding each key (two prompts with a common prefix share its blocks)."""

    kind = "stream"
    saves = False            # the connector never saves an evicted block here
    always_reload = True     # already in memory: loading beats recomputing
    verified = True          # every frame's checksum and each block's were checked on arrival

    def __init__(self):
        super().__init__("stream")
        self._blocks: dict[bytes, list] = {}      # key -> [payload, refcount]
        self._lock = threading.Lock()

    def contains_many(self, keys):
        with self._lock:
            return [k in self._blocks for k in keys]

    def get(self, key):
        with self._lock:
            e = self._blocks.get(key)
            return None if e is None else e[0]

    def put_many(self, items):
        return []

    def delete(self, key):
        """A payload that failed its checksum: dropped."""
        with self._lock:
            self._blocks.pop(key, None)

    def usage(self):
        with self._lock:
            return len(self._blocks), sum(len(p) for p, _ in self._blocks.values())

    def add(self, items: list[tuple[bytes, bytes]]) -> None:
        with self._lock:
            for k, p in items:
                e = self._blocks.setdefault(k, [p, 0])
                e[1] += 1

    def drop(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                e = self._blocks.get(k)
                if e is not None:
                    e[1] -= 1
                    if e[1] <= 0:
                        del self._blocks[k]


@dataclass
class Transfer:
    transfer_id: str
    reserved: int                      # bytes held back for it
    state: str = PENDING
    reason: str = ""
    parts: dict = field(default_factory=dict)     # key -> its BlockAssembly (layers arrive in order)
    held: int = 0                      # bytes of its parts, then of its payloads
    keys: list = field(default_factory=list)      # its blocks in the inbox, once complete
    claimed: bool = False              # a request waits on it
    opened: bool = False
    touched: float = field(default_factory=time.monotonic)
    t_reserved: float = field(default_factory=time.monotonic)
    t_done: float | None = None


class KVStreamReceiver:
    def __init__(self, host: str, port: int, capacity: int, block_bytes: int, num_layers: int,
                 block_size: int, scope: bytes, timeout_s: float = 60.0, inbox: StreamInbox | None = None):
        self.capacity, self.block_bytes, self.num_layers = int(capacity), block_bytes, num_layers
        self.layer_bytes = block_bytes // num_layers
        self.block_size, self.scope, self.timeout_s = block_size, scope, timeout_s
        self.inbox = inbox if inbox is not None else StreamInbox()     # the decode engine's top KV tier
        self.transfers: dict[str, Transfer] = {}
        self.counts: Counter = Counter()     # reserved, refused:<why>, completed, failed:<why>, ...
        self.bytes_received = 0
        self.blocks_received = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvserve-kv-stream", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    # -- the engine's side ----------------------------------------------------------------------
    def poll(self, transfer_id: str) -> tuple[str, str]:
        """(pending | complete | failed, why) of a transfer a request waits on; an id this
        receiver does not know (never reserved, or dropped) is failed."""
        with self._lock:
            self._expire()
            t = self.transfers.get(transfer_id)
            if t is None:
                return FAILED, "unknown transfer id"
            t.claimed = True
            return t.state, t.reason

    def release(self, transfer_id: str) -> None:
        """The request is admitted (its blocks are in the pool now) or gone: free the transfer."""
        with self._lock:
            t = self.transfers.pop(transfer_id, None)
            if t is not None:
                self._free(t)

    def used(self) -> int:
        """Bytes reserved or held (under the lock)."""
        return sum(max(t.reserved, t.held) for t in self.transfers.values())

    def stats_dict(self) -> dict:
        with self._lock:
            return {"address": self.address, "capacity_bytes": self.capacity, "used_bytes": self.used(),
                    "transfers": len(self.transfers), "bytes_received": self.bytes_received,
                    "blocks_received": self.blocks_received, **dict(self.counts)}

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    # -- the transfers' state, under the lock ---------------------------------------------------
    def _free(self, t: Transfer) -> None:
        if t.keys:
            self.inbox.drop(t.keys)
        t.parts, t.keys, t.held, t.reserved = {}, [], 0, 0

    def _fail(self, t: Transfer, why: str) -> None:
        if t.state == PENDING:
            t.state, t.reason = FAILED, why
            self.counts[f"failed:{why}"] += 1
            self._free(t)
            logger.warning("KV stream %s failed: %s (its prompt is recomputed)", t.transfer_id, why)

    def _expire(self) -> None:
        now = time.monotonic()
        for tid, t in list(self.transfers.items()):
            if now - t.touched <= self.timeout_s:
                continue
            if t.state == PENDING:
                self._fail(t, "stalled")
                t.touched = now
            elif not t.claimed:              # nobody came for it: dropped
                self._free(t)
                del self.transfers[tid]
                self.counts["unclaimed"] += 1

    # -- the wire -------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kvserve-kv-stream-conn",
                             daemon=True).start()

    def _reply(self, conn, ok: bool, reason: str = "") -> None:
        conn.sendall(b"".join(json_frame(REPLY, {"ok": ok, "reason": reason})))

    def _serve(self, conn: socket.socket) -> None:
        t: Transfer | None = None
        try:
            with conn:
                while True:
                    kind, body = read_frame(conn, 16 + (1 << 20) + 4096 * (32 + self.layer_bytes))
                    if kind == RESERVE:
                        self._reply(conn, *self._reserve(json.loads(body)))
                        return
                    if kind == CANCEL:
                        req = json.loads(body)
                        with self._lock:
                            c = self.transfers.get(str(req.get("transfer_id")))
                            if c is not None:
                                self._fail(c, "cancelled: " + str(req.get("reason")))
                        self._reply(conn, c is not None)
                        return
                    if kind == OPEN:
                        t, ok, why = self._open(json.loads(body))
                        self._reply(conn, ok, why)
                        if not ok:
                            return
                    elif t is None:
                        raise WireError("a transfer's frame before its OPEN")
                    elif kind == LAYER:
                        self._layer(t, body)
                    elif kind == DONE:
                        self._done(t, json.loads(body))
                        return
                    elif kind == ABORT:
                        with self._lock:
                            self._fail(t, "aborted by the sender: " + str(json.loads(body).get("reason")))
                        return
                    else:
                        raise WireError(f"unknown frame kind {kind}")
        except (OSError, ValueError) as e:      # WireError is an OSError; bad JSON a ValueError
            if t is not None:
                with self._lock:
                    self._fail(t, "connection lost")
            logger.debug("KV stream connection ended: %s", e)

    def _reserve(self, req: dict) -> tuple[bool, str]:
        tid, tokens = str(req.get("transfer_id") or ""), int(req.get("tokens") or 0)
        need = max(tokens - 1, 0) // self.block_size * self.block_bytes     # the prompt's full blocks
        with self._lock:
            self._expire()
            if not tid or tid in self.transfers:
                self.counts["refused:bad id"] += 1
                return False, f"transfer id {tid!r} is empty or in use"
            if need > self.capacity:
                self.counts["refused:too large"] += 1
                return False, (f"the prompt's KV ({need} bytes) is larger than this decode instance's "
                               f"stream buffer ({self.capacity} bytes)")
            if self.used() + need > self.capacity:
                self.counts["refused:full"] += 1
                return False, "the decode instance's KV stream buffer is full"
            self.transfers[tid] = Transfer(tid, need)
            self.counts["reserved"] += 1
            return True, ""

    def _open(self, req: dict) -> tuple[Transfer | None, bool, str]:
        tid = str(req.get("transfer_id") or "")
        layout = (int(req.get("num_layers", -1)), int(req.get("layer_bytes", -1)),
                  int(req.get("block_size", -1)), str(req.get("scope", "")))
        with self._lock:
            t = self.transfers.get(tid)
            if t is None or t.state != PENDING or t.opened:
                self.counts["refused:unknown id"] += 1
                return None, False, f"no open reservation {tid!r}"
            t.opened, t.touched = True, time.monotonic()
            if layout != (self.num_layers, self.layer_bytes, self.block_size, self.scope.hex()):
                self._fail(t, "another model or KV layout")
                return None, False, "the sender's KV layout or weights differ from this instance's"
            return t, True, ""

    def _layer(self, t: Transfer, body: bytes) -> None:
        layer, keys, data = parse_layer(body, self.layer_bytes)
        if layer >= self.num_layers:
            raise WireError(f"layer {layer} of {self.num_layers}")
        lb = self.layer_bytes
        with self._lock:
            if t.state != PENDING:
                return
            t.touched = time.monotonic()
            grow = sum(k not in t.parts for k in keys) * self.block_bytes      # blocks' buffers, at layer 0
            extra = max(t.reserved, t.held + grow) - max(t.reserved, t.held)   # past its reservation
            if extra and self.used() + extra > self.capacity:
                self._fail(t, "overflow")
                return
            for i, k in enumerate(keys):
                a = t.parts.get(k)
                if a is None:
                    if layer:
                        raise WireError(f"block {k.hex()[:8]}'s layer {layer} before its layer 0")
                    a = t.parts[k] = BlockAssembly(k, self.block_bytes)
                    t.held += self.block_bytes
                elif a.received != layer * lb:
                    raise WireError(f"block {k.hex()[:8]}'s layer {layer} out of order")
                a.add(data[i * lb:(i + 1) * lb])
            self.bytes_received += len(data)

    def _done(self, t: Transfer, req: dict) -> None:
        with self._lock:
            if t.state != PENDING:
                return
            if not all(a.full for a in t.parts.values()) or len(t.parts) != int(req.get("num_blocks", -1)):
                self._fail(t, "incomplete")
                return
            items = [(k, a.payload()) for k, a in t.parts.items()]
            t.parts = {}
            self.inbox.add(items)
            t.keys = [k for k, _ in items]
            t.state, t.t_done, t.touched = COMPLETE, time.monotonic(), time.monotonic()
            self.blocks_received += len(items)
            self.counts["completed"] += 1
