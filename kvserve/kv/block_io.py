"""The payload of one KV block outside the pool (kv/connector.py, seed 003 "Tiers of KV storage"):
its checksummed envelope and the scope of the store keys (the runner copies its bytes out of and
into the per-layer pools: worker/kv_blocks.py).

Payload: b"KVB1" | key (32 bytes) | len (u64) | data | crc32(key + data). A payload that is
truncated, carries another key or fails the checksum reads as a miss (`unpack_block`), so a
corrupt block is recomputed, never served.
data = every pool tensor of every layer (K, V; values then scales when quantized) for that
block, as raw bytes, in `ModelRunner.kv_cache_tensors()` order: [n_layers x 2 x (1 or 2)] slices of
[n_kv_heads, block_size, head_dim] (scales [n_kv_heads, block_size]).
"""
from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

MAGIC = b"KVB1"
_HEAD = len(MAGIC) + 32 + 8


def pack_block(key: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data, zlib.crc32(key))
    return b"".join((MAGIC, key, struct.pack("<Q", len(data)), data, struct.pack("<I", crc)))


def unpack_block(key: bytes, payload: bytes | None, size: int, verified: bool = False) -> bytes | None:
    """The block's data, or None when missing, for another key, truncated or corrupt;
    `verified`: the store checked the checksum as the payload came in (a KV stream's inbox)."""
    if payload is None or len(payload) != _HEAD + size + 4 or payload[:4] != MAGIC:
        return None
    if payload[4:36] != key or struct.unpack_from("<Q", payload, 36)[0] != size:
        return None
    data = memoryview(payload)[_HEAD:_HEAD + size]
    if not verified and zlib.crc32(data, zlib.crc32(key)) != struct.unpack_from("<I", payload, _HEAD + size)[0]:
        return None
    return data


class BlockAssembly:
    """One block's payload built in place as its parts arrive in order (a KV stream's layers):
    the envelope of `pack_block`, the checksum carried along, no copy at the end."""

    __slots__ = ("buf", "off", "crc", "end")

    def __init__(self, key: bytes, size: int):
        self.buf = bytearray(_HEAD + size + 4)
        self.buf[:_HEAD] = MAGIC + key + struct.pack("<Q", size)
        self.off, self.end, self.crc = _HEAD, _HEAD + size, zlib.crc32(key)

    def add(self, part) -> None:
        """The next `len(part)` bytes of the data (in order)."""
        n = len(part)
        self.buf[self.off:self.off + n] = part
        self.crc = zlib.crc32(part, self.crc)
        self.off += n

    @property
    def received(self) -> int:
        """Bytes of the data in so far."""
        return self.off - _HEAD

    @property
    def full(self) -> bool:
        return self.off == self.end

    def payload(self) -> bytearray:
        struct.pack_into("<I", self.buf, self.end, self.crc)
        return self.buf


def store_key(scope: bytes, block_hash: bytes) -> bytes:
    """A block's key in a store (a tier, a KV stream): sha256(scope + chained block hash)."""
    return hashlib.sha256(scope + block_hash).digest() if scope else block_hash


PAYLOAD_OVERHEAD = _HEAD + 4


def load_into(runner, loads: list[tuple[int, bytes]], size: int) -> None:
    """loads: (pool block, verified data of `size` bytes) -> written into the pool by the
    runner (`write_kv_blocks`, worker/kv_blocks.py)."""
    buf = bytearray(len(loads) * size)                  # one copy of the payloads' data, no more
    for i, (_, d) in enumerate(loads):
        buf[i * size:(i + 1) * size] = d
    runner.write_kv_blocks([b for b, _ in loads], buf)


def _sample_digest(path: Path, h) -> None:
    """Size and three 1 MiB samples (head, middle, tail) of a weights file: cheap at start for
    any size, and different for any fine-tune of the same shape."""
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        for at in (0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))):
            f.seek(at)
            h.update(f.read(1 << 20))


def store_scope(model: str, dtype: str, kv_cache_dtype: str, quantization: str | None,
                quantization_group_size: int | None, block_size: int) -> bytes:
    """A fingerprint of what K/V depend on beyond the prefix-cache namespace (model path, dtype,
    kv_cache_dtype): the weight files' contents (sampled), the weight quantization and the
    block size. Store keys are sha256(scope + chained block hash)."""
    h = hashlib.sha256()
    h.update(repr((model, dtype, kv_cache_dtype, quantization, quantization_group_size, block_size)).encode())
    path = Path(model)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    for f in files:
        if f.suffix in (".safetensors", ".bin", ".gguf", ".pt", ".pth") or f.name == "config.json":
            _sample_digest(f, h)
    return h.digest()
