"""A GGUF file read with every length checked before it is used: its key-value metadata as Python
values and its tensors as read-only views of one memory map (`read_gguf`).

gguf-py's `GGUFReader` trusts every length in the file (a string or array length past the end
reads empty slices and never advances, so one crafted u64 makes it loop for ever while memory
grows), and it keeps a numpy view for every item of every array: on SmolLM2's GGUF (two
49,152-entry string arrays) it held 164 MB of anonymous memory, more than the model's weights.
This reader walks the same layout (llama.cpp's gguf.md: magic, version, tensor and KV counts;
per KV a string key, a u32 type and the value; per tensor a name, n_dims, dims, a u32 type and a
data offset), checks each length against the bytes left *before* reading what it covers, so it
is O(file size): every element it visits takes at least one byte of the file, and keeps only
the values. Tensor data (offset, size from the type's block size) must lie inside the file too.
Anything wrong is a `ValueError` naming the field. The tensors are gguf-py's shapes and dtypes
(`GGUFTensor`: a quantized tensor's data is its rows of raw block bytes).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)      # gguf-py's reader reads these (version 1 had u32 lengths)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                     # GGML_MAX_DIMS
SCALAR_FORMATS = {               # value type -> struct format (without the byte order)
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
ELEMENT_DTYPES = {               # tensor types stored as plain elements (gguf-py's data dtypes)
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    """One tensor as gguf-py's ReaderTensor has it: `shape` in GGUF's order (ne0 first), `data`
    a read-only view of the file in torch's order ([..., rows, columns]; a quantized type's last
    axis is each row's block bytes, uint8)."""
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data: np.ndarray


@dataclass
class GGUFFile:
    metadata: dict          # key -> str, int, float, bool, or a list of them
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """The file at `path`, every length checked (module doc); ValueError naming the field."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes "
                             "'GGUF'); pass a .gguf file written by llama.cpp or gguf-py.")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            metadata, infos, data_start = _walk(_Cursor(buf, repr(str(path))))
    mapped = np.memmap(path, mode="r")
    tensors = []
    for name, dims, qtype, offset, nbytes in infos:
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        start = data_start + offset
        shape = tuple(reversed(dims))
        if qtype in ELEMENT_DTYPES:
            data = mapped[start:start + nbytes].view(ELEMENT_DTYPES[qtype]).reshape(shape)
        else:
            block, type_size = GGML_QUANT_SIZES[qtype]
            data = mapped[start:start + nbytes].reshape(*shape[:-1], shape[-1] // block * type_size)
        tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elements, nbytes, data))
    return GGUFFile(metadata, tensors)


class _Cursor:
    """Reads little- or big-endian values from `buf` (an mmap), each checked against the bytes
    left."""

    def __init__(self, buf, where: str):
        self.buf, self.pos, self.order, self.where = buf, 0, "<", where

    def left(self) -> int:
        return len(self.buf) - self.pos

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left():
            raise ValueError(f"{self.where}: {what} needs {nbytes} bytes at offset {self.pos} but "
                             f"only {self.left()} remain; the file is truncated or corrupt.")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, nbytes: int, what: str) -> None:
        self.need(nbytes, what)
        self.pos += nbytes

    def string(self, what: str) -> bytes:
        n = self.scalar("Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s

    def value_type(self, what: str) -> GGUFValueType:
        raw = self.scalar("I", f"the type of {what}")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise ValueError(f"{self.where}: {what} has unknown value type {raw}; the file is "
                             "corrupt.") from None


def check_gguf(path: str | Path) -> None:
    """ValueError naming the field if any length, type, count, offset or size of the file at
    `path` does not fit in it."""
    read_gguf(path)


def _walk(c: _Cursor) -> tuple[dict, list, int]:
    """(metadata, tensor infos (name, dims, type, offset, bytes), where the tensor data starts)."""
    c.pos = 4                                     # after the magic
    version = c.scalar("I", "the version")
    if version & 0xFFFF == 0:                     # written on a big-endian machine
        c.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"{c.where} is GGUF version {version}; kvserve reads versions "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))}.")
    n_tensors = c.scalar("Q", "the tensor count")
    n_kv = c.scalar("Q", "the metadata count")
    c.need(n_kv * 13, f"{n_kv} metadata entries")           # key length, type, one byte of value
    alignment = DEFAULT_ALIGNMENT
    keys: set[str] = set()
    metadata: dict = {}
    for i in range(n_kv):
        key = _unique_name(c, f"the key of metadata entry {i}", "metadata key", keys)
        vtype = c.value_type(f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise ValueError(f"{c.where}: general.alignment has type {vtype.name}, not UINT32.")
            alignment = c.scalar("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"{c.where}: general.alignment {alignment} is not a power of two.")
            metadata[key] = alignment
        else:
            metadata[key] = _read_value(c, vtype, f"metadata {key!r}")
    c.need(n_tensors * 24, f"{n_tensors} tensor infos")      # name length, n_dims, type, offset
    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = _unique_name(c, f"the name of tensor {i}", "tensor", names)
        n_dims = c.scalar("I", f"tensor {name!r}'s n_dims")
        if n_dims > MAX_DIMS:
            raise ValueError(f"{c.where}: tensor {name!r} has {n_dims} dimensions; GGUF allows "
                             f"at most {MAX_DIMS}.")
        dims = [c.scalar("Q", f"tensor {name!r}'s dimensions") for _ in range(n_dims)]
        raw = c.scalar("I", f"tensor {name!r}'s type")
        offset = c.scalar("Q", f"tensor {name!r}'s data offset")
        tensors.append((name, dims, raw, offset))
    data_start = -(-c.pos // alignment) * alignment
    infos = []
    for name, dims, raw, offset in tensors:
        qtype, nbytes = _check_tensor_data(c, name, dims, raw, offset, data_start, alignment)
        infos.append((name, dims, qtype, offset, nbytes))
    return metadata, infos, data_start


def _unique_name(c: _Cursor, what: str, kind: str, seen: set[str]) -> str:
    """The next string (a metadata key or a tensor name), UTF-8 and not in `seen`; added to it."""
    name = _utf8(c.string(what), what, c)
    if name in seen:
        raise ValueError(f"{c.where}: {kind} {name!r} appears twice; the file is corrupt.")
    seen.add(name)
    return name


def _utf8(raw: bytes, what: str, c: _Cursor) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{c.where}: {what} is not UTF-8 ({raw[:32]!r}...); the file is corrupt.") from None


def _read_value(c: _Cursor, vtype: GGUFValueType, what: str):
    """One value as Python's (an array's as a list); its length is checked against the bytes
    left before its items are visited (strings one by one, scalars in one step)."""
    if vtype == GGUFValueType.STRING:
        return _utf8(c.string(what), what, c)
    if vtype in SCALAR_FORMATS:
        return c.scalar(SCALAR_FORMATS[vtype], what)
    itype = c.value_type(f"the items of {what}")      # ARRAY: item type, count, items
    count = c.scalar("Q", f"the length of {what}")
    if itype == GGUFValueType.ARRAY:
        raise ValueError(f"{c.where}: {what} is an array of arrays, which GGUF readers "
                         "(llama.cpp's included) do not support.")
    if itype == GGUFValueType.STRING:
        c.need(count * 8, f"{what} ({count} strings)")
        return [_utf8(c.string(f"item {j} of {what}"), f"item {j} of {what}", c) for j in range(count)]
    fmt = SCALAR_FORMATS[itype]
    size = struct.calcsize(fmt)
    c.need(count * size, f"{what} ({count} items)")
    items = np.frombuffer(c.buf, dtype=np.dtype(c.order + fmt), count=count, offset=c.pos).tolist()
    c.pos += count * size
    return items


def _check_tensor_data(c: _Cursor, name: str, dims: list[int], raw: int, offset: int,
                       data_start: int, alignment: int) -> tuple[GGMLQuantizationType, int]:
    """The tensor's type is known and its bytes lie inside the file, aligned: (type, bytes)."""
    try:
        qtype = GGMLQuantizationType(raw)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"{c.where}: tensor {name!r} has unknown type {raw}; the file is "
                         "corrupt or newer than this gguf package.") from None
    if dims and dims[0] % block:
        raise ValueError(f"{c.where}: tensor {name!r} ({qtype.name}) has {dims[0]} columns, not "
                         f"a multiple of its block size {block}.")
    n_elements = 1
    for d in dims:
        n_elements *= d
    nbytes = n_elements // block * type_size
    if offset % alignment:
        raise ValueError(f"{c.where}: tensor {name!r}'s data offset {offset} is not a multiple "
                         f"of the alignment {alignment}.")
    end = data_start + offset + nbytes
    if end > len(c.buf):
        raise ValueError(f"{c.where}: tensor {name!r} (shape {dims}, {qtype.name}, {nbytes} bytes "
                         f"at offset {data_start + offset}) ends at byte {end}, past the end of the "
                         f"{len(c.buf)}-byte file; the file is truncated or corrupt.")
    return qtype, nbytes
