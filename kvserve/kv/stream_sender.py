"""The prefill instance's side of layer-wise KV streaming (kv/stream_wire.py; seed 000: "as soon
as layer 1 finishes its prefill, it starts transmitting its KV cache chunks").

The engine opens a transfer for each request that names a decode instance
(`kv_transfer_params: {"transfer_id", "stream_to"}`), tells the sender before each step which
of those requests' blocks become full in it (`plan`: pool block ids and store keys), and once
layer l's K/V of the step are in the pool the model runner copies that layer's slices of those
blocks out of the pool (`layer_data`: a copy, so the pool may be reused at once) and a thread of
the sender's own sends them while the next layers run. After the request's last prefill
step the engine ends the transfer (`done`); a request that ends first aborts it.

Unit "prompt" holds a transfer's layers until `done` and sends them then: the whole-prompt
transfer that layer-wise streaming is measured against, over the same link. `rate` puts a token
bucket on the link. Bounded memory: copies queued and not yet sent never pass `buffer_bytes`;
a transfer that would pass it is aborted (its decode side recomputes), the engine never waits.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from kvserve.kv.stream_wire import (ABORT, DONE, LAYER, OPEN, REPLY, TokenBucket, json_frame, frame,
                                    layer_body, parse_address, read_json)

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_FRAME = 1024
SEND_CHUNK = 1 << 18


@dataclass
class Outgoing:
    request_id: str
    transfer_id: str
    address: str
    blocks: int = 0                  # blocks planned so far (each sent in every layer)
    failed: str = ""
    held: list = field(default_factory=list)      # unit "prompt": LAYER items until done
    sock: socket.socket | None = None
    t_done: float | None = None      # when the engine ended it (the prefill's end)


class KVStreamSender:
    def __init__(self, block_size: int, scope: bytes, rate: float = 0.0, buffer_bytes: int = 1 << 30,
                 unit: str = "layer", connect_timeout: float = 5.0, send_timeout: float = 60.0):
        self.block_size, self.scope, self.unit = block_size, scope, unit
        self.buffer_bytes, self.connect_timeout, self.send_timeout = buffer_bytes, connect_timeout, send_timeout
        self.bucket = TokenBucket(rate)
        self.out: dict[str, Outgoing] = {}            # request id -> its transfer
        self.counts: Counter = Counter()
        self.bytes_sent = 0
        self.blocks_sent = 0
        self.tail_s: list[float] = []                 # per transfer: its end sent minus the prefill's end
        self._queued = 0                              # bytes queued, not yet sent
        self._lock = threading.Lock()
        self._step: list[tuple[Outgoing, list[int], list[bytes]]] = []
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-stream-send", daemon=True)
        self._thread.start()
        self.num_layers = self.layer_bytes = 0

    def bind(self, runner) -> None:
        """Become the runner's `kv_stream`: it hands over each layer's slices (`layer_data`)."""
        runner.kv_stream = self
        self.num_layers, self.layer_bytes = runner.kv_layer_layout()

    # -- the engine's side ----------------------------------------------------------------------
    def open(self, request_id: str, transfer_id: str, address: str) -> None:
        o = Outgoing(request_id, transfer_id, address)
        self.out[request_id] = o
        self.counts["opened"] += 1
        self._put(o, OPEN, {"transfer_id": transfer_id, "num_layers": self.num_layers,
                            "layer_bytes": self.layer_bytes, "block_size": self.block_size,
                            "scope": self.scope.hex()}, 0)

    def plan(self, items: list[tuple[str, list[int], list[bytes]]]) -> None:
        """This step's newly full blocks: (request id, pool block ids, store keys)."""
        self._step = []
        for rid, block_ids, keys in items:
            o = self.out.get(rid)
            if o is None or o.failed or not block_ids:
                continue
            o.blocks += len(block_ids)
            self._step.append((o, block_ids, keys))

    def step_plan(self) -> list[tuple[Outgoing, list[int], list[bytes]]]:
        """The step's (transfer, pool block ids, store keys) whose layers the runner hands over."""
        return [item for item in self._step if not item[0].failed]

    def layer_data(self, o: Outgoing, layer: int, keys: list[bytes], data: bytes) -> None:
        """Layer `layer`'s slices of the blocks `keys` (a copy out of the pool, n x layer_bytes)."""
        lb, step = self.layer_bytes, MAX_BLOCKS_PER_FRAME
        for a in range(0, len(keys), step):
            item = (layer, keys[a:a + step], data[a * lb:(a + step) * lb])
            if self.unit == "prompt":
                if not self._reserve(o, len(item[2])):
                    break
                o.held.append(item)
            else:
                self._put(o, LAYER, item, len(item[2]))

    def end_step(self) -> None:
        self._step = []

    def done(self, request_id: str) -> None:
        """The request's prefill is over: every layer of every planned block is queued."""
        o = self.out.pop(request_id, None)
        if o is None or o.failed:
            return
        for item in o.held:
            self._q.put((o, LAYER, item, len(item[2])))
        o.held = []
        o.t_done = time.monotonic()
        self.counts["done"] += 1
        self._put(o, DONE, {"num_blocks": o.blocks}, 0)

    def abort(self, request_id: str, reason: str) -> None:
        o = self.out.pop(request_id, None)
        if o is not None and not o.failed:
            self._abort(o, reason)

    def stats_dict(self) -> dict:
        tails = sorted(self.tail_s)
        return {"open": len(self.out), "bytes_sent": self.bytes_sent, "blocks_sent": self.blocks_sent,
                "queued_bytes": self._queued, "rate_bytes_per_s": self.bucket.rate, "unit": self.unit,
                "tail_s_median": tails[len(tails) // 2] if tails else None, **dict(self.counts)}

    def close(self) -> None:
        self._q.put(None)

    # -- queueing -------------------------------------------------------------------------------
    def _reserve(self, o: Outgoing, n: int) -> bool:
        with self._lock:
            if self._queued + n > self.buffer_bytes:
                full = True
            else:
                self._queued += n
                full = False
        if full:
            self._abort(o, "the sender's buffer is full (the link is slower than the prefill)")
            return False
        return True

    def _put(self, o: Outgoing, kind: int, payload, n: int) -> None:
        if n and not self._reserve(o, n):
            return
        self._q.put((o, kind, payload, n))

    def _abort(self, o: Outgoing, reason: str) -> None:
        o.failed = reason
        self.counts[f"aborted:{reason}"] += 1
        with self._lock:
            self._queued -= sum(len(item[2]) for item in o.held)
        o.held = []
        self._q.put((o, ABORT, {"reason": reason}, 0))

    # -- the link -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            got = self._q.get()
            if got is None:
                return
            o, kind, payload, n = got
            try:
                if kind == ABORT:
                    if o.sock is not None:
                        self._send(o, json_frame(ABORT, payload))
                    self._close(o)
                elif kind == OPEN:                    # (first: an abort queued after it is sent)
                    self._connect(o, payload)
                elif o.failed:
                    pass                              # an aborted transfer's queued frames: dropped
                elif kind == LAYER:
                    layer, keys, data = payload
                    self._send(o, frame(LAYER, layer_body(layer, keys, data)))
                    self.blocks_sent += len(keys) if layer == 0 else 0
                elif kind == DONE:
                    self._send(o, json_frame(DONE, payload))
                    self.tail_s.append(time.monotonic() - o.t_done)
                    del self.tail_s[:-1024]
                    self._close(o)
            except (OSError, ValueError) as e:
                if not o.failed:
                    o.failed = f"link: {e}"
                    self.counts["failed:link"] += 1
                    logger.warning("KV stream %s to %s failed: %s (the decode side recomputes)",
                                   o.transfer_id, o.address, e)
                self._close(o)
            finally:
                if n:
                    with self._lock:
                        self._queued -= n

    def _connect(self, o: Outgoing, header: dict) -> None:
        o.sock = socket.create_connection(parse_address(o.address), timeout=self.connect_timeout)
        o.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        o.sock.sendall(b"".join(json_frame(OPEN, header)))
        reply = read_json(o.sock, REPLY)
        if not reply.get("ok"):
            raise ValueError(f"the decode instance refused the transfer: {reply.get('reason')}")
        o.sock.settimeout(self.send_timeout)        # a decode instance that stops reading: a failure

    def _send(self, o: Outgoing, parts: list[bytes]) -> None:
        if o.sock is None:
            raise OSError("no connection")
        for part in parts:
            view = memoryview(part)
            for a in range(0, len(view), SEND_CHUNK):
                chunk = view[a:a + SEND_CHUNK]
                self.bucket.take(len(chunk))
                o.sock.sendall(chunk)
                self.bytes_sent += len(chunk)

    @staticmethod
    def _close(o: Outgoing) -> None:
        if o.sock is not None:
            try:
                o.sock.close()
            except OSError:
                pass
            o.sock = None
