"""The wire of layer-wise KV streaming between a prefill and a decode instance (seed 000, "as
soon as layer 1 finishes its prefill, it starts transmitting its KV cache chunks"; seed 003,
connectors that "stream the cache layer by layer ... while the prefill is still running").

One TCP connection per transfer, sender (the prefill instance) to receiver (the decode
instance), and one short connection per reservation (the proxy). Every message is a frame:

    b"KVS1" | kind (u8) | length (u64) | body | crc32(kind + body) (u32)

kinds and bodies:
    RESERVE  proxy -> receiver   json {"transfer_id", "tokens"}: hold room for a prompt's KV
    OPEN     sender -> receiver  json {"transfer_id", "num_layers", "layer_bytes", "block_size", "scope"}
    LAYER    sender -> receiver  layer (u32) | n (u32) | n store keys (32 bytes each) |
                                 n x layer_bytes: each block's slices of that layer's pool tensors
    DONE     sender -> receiver  json {"num_blocks"}: every layer of every block was sent
    ABORT    sender -> receiver  json {"reason"}
    REPLY    receiver -> either  json {"ok": bool, "reason"}: the answer to RESERVE, OPEN and CANCEL
    CANCEL   proxy -> receiver   json {"transfer_id", "reason"}: no prefill will send it (recompute now)

A block's payload on the receiving side is its layers' parts in layer order, which is
`ModelRunner.kv_cache_tensors()` order (kv/block_io.py): the same bytes a KV tier holds, keyed
by the same store key, so the decode instance loads a streamed block as a tier hit.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib

MAGIC = b"KVS1"
RESERVE, OPEN, LAYER, DONE, ABORT, REPLY, CANCEL = range(1, 8)
_HEAD = struct.Struct("<4sBQ")
_LAYER_HEAD = struct.Struct("<II")
KEY_BYTES = 32
MAX_FRAME = 1 << 32          # a frame longer than this is refused (a broken or hostile peer)


class WireError(ConnectionError):
    """A frame that is truncated, corrupt or not a frame: the connection is dropped."""


def frame(kind: int, body: bytes) -> list[bytes]:
    """The parts of one frame (sent with sendmsg, without joining a large body)."""
    crc = zlib.crc32(body, zlib.crc32(bytes([kind])))
    return [_HEAD.pack(MAGIC, kind, len(body)), body, struct.pack("<I", crc)]


def json_frame(kind: int, obj: dict) -> list[bytes]:
    return frame(kind, json.dumps(obj).encode())


def layer_body(layer: int, keys: list[bytes], data: bytes) -> bytes:
    return b"".join([_LAYER_HEAD.pack(layer, len(keys)), *keys, data])


def parse_layer(body: bytes, layer_bytes: int) -> tuple[int, list[bytes], memoryview]:
    """LAYER body -> (layer, keys, data [n x layer_bytes])."""
    if len(body) < _LAYER_HEAD.size:
        raise WireError("a LAYER frame shorter than its header")
    layer, n = _LAYER_HEAD.unpack_from(body)
    off = _LAYER_HEAD.size
    if len(body) != off + n * (KEY_BYTES + layer_bytes):
        raise WireError(f"a LAYER frame of {len(body)} bytes for {n} blocks of {layer_bytes} bytes")
    keys = [bytes(body[off + i * KEY_BYTES: off + (i + 1) * KEY_BYTES]) for i in range(n)]
    return layer, keys, memoryview(body)[off + n * KEY_BYTES:]


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket, max_body: int = MAX_FRAME) -> tuple[int, bytes]:
    magic, kind, n = _HEAD.unpack(_read_exact(sock, _HEAD.size))
    if magic != MAGIC:
        raise WireError("not a KV stream frame")
    if n > max_body:
        raise WireError(f"a frame of {n} bytes (at most {max_body})")
    body = _read_exact(sock, n)
    (crc,) = struct.unpack("<I", _read_exact(sock, 4))
    if zlib.crc32(body, zlib.crc32(bytes([kind]))) != crc:
        raise WireError("a frame failed its checksum")
    return kind, body


def read_json(sock: socket.socket, expect: int) -> dict:
    kind, body = read_frame(sock, 1 << 20)
    if kind != expect:
        raise WireError(f"expected frame kind {expect}, got {kind}")
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise WireError(f"a frame's JSON body does not parse: {e}") from None
    if not isinstance(obj, dict):
        raise WireError("a frame's JSON body is not an object")
    return obj


def parse_address(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port); ValueError otherwise."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"a KV stream address must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def reserve(addr: str, transfer_id: str, tokens: int, timeout: float = 5.0) -> tuple[bool, str]:
    """Ask the decode instance at `addr` to hold room for `tokens` tokens of KV under
    `transfer_id`: (True, "") or (False, why). Connection errors raise OSError."""
    with socket.create_connection(parse_address(addr), timeout=timeout) as s:
        s.sendall(b"".join(json_frame(RESERVE, {"transfer_id": transfer_id, "tokens": int(tokens)})))
        reply = read_json(s, REPLY)
    return bool(reply.get("ok")), str(reply.get("reason") or "")


def cancel(addr: str, transfer_id: str, reason: str, timeout: float = 5.0) -> None:
    """Tell the decode instance at `addr` that transfer `transfer_id` will not come: its request
    computes the prompt at once instead of waiting for the stall timeout."""
    with socket.create_connection(parse_address(addr), timeout=timeout) as s:
        s.sendall(b"".join(json_frame(CANCEL, {"transfer_id": transfer_id, "reason": reason})))
        read_json(s, REPLY)


class TokenBucket:
    """A link of `rate` bytes per second with a `burst` of bytes: `take(n)` waits until n bytes
    may go (an artificially limited link, so that the transfer matters in a benchmark; seed
    003's b_tier). rate 0: unlimited."""

    def __init__(self, rate: float, burst: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else rate / 20)     # 50 ms of the link
        self._level = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self._lock:
            while True:
                now = time.monotonic()
                self._level = min(self.burst, self._level + (now - self._t) * self.rate)
                self._t = now
                if self._level >= min(n, self.burst):
                    self._level -= n          # may go negative: a large chunk pays its debt after
                    return
                time.sleep((min(n, self.burst) - self._level) / self.rate)
