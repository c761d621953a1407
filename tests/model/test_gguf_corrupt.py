"""Corrupt GGUF files: every one is a ValueError or a clean load, in bounded time and memory.

Each load runs in one long-lived worker process (address space capped with RLIMIT_AS, every
answer awaited with a timeout), so a hang or a runaway allocation fails the test instead of
stalling it. Hypothesis corrupts stories260K's GGUF file where it matters: the length fields
(key, string, array), the type fields, the counts, the tensor data offsets, truncations and
byte flips anywhere."""
from __future__ import annotations

import json
import select
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.model.loaders.gguf_file import check_gguf
from tests.model.gguf_files import STORIES_GGUF, write_out

LOAD_TIMEOUT_S = 10.0              # a clean load of this 1 MB file takes ~15 ms
MEMORY_BOUND = 512 * 2**20         # address space the worker may add per load, over its start

WORKER = """
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from kvserve.model.loaders.gguf import load_gguf
load_gguf(sys.argv[1])                                    # warm: imports and first-load caches
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
limit = vm + int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    try:
        load_gguf(line.strip())
        out = {"result": "loaded"}
    except ValueError as e:
        out = {"result": "ValueError", "message": str(e)}
    except BaseException as e:
        out = {"result": type(e).__name__, "message": repr(e)[:500]}
    out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
"""


class LoadWorker:
    """load_gguf in a child process: `load(path)` -> its JSON answer, or AssertionError when it
    does not answer within LOAD_TIMEOUT_S (the child is killed)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(STORIES_GGUF), str(MEMORY_BOUND)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._answer(120.0, "start").get("ready")

    def _answer(self, timeout: float, what: str) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the load worker gave no answer for {what} within {timeout} s "
                                 "(a hang, or it died)")
        return json.loads(line)

    def load(self, path) -> dict:
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return self._answer(LOAD_TIMEOUT_S, str(path))

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def worker():
    w = LoadWorker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("corrupt") / "model.gguf"


ORIGINAL = STORIES_GGUF.read_bytes()


def _field_offsets() -> dict[str, list[int]]:
    """Byte offsets in ORIGINAL of its u64 lengths, u32 value/tensor types, counts (u64 header
    counts, u32 n_dims) and u64 tensor data offsets, from gguf-py's own reading of the file."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(STORIES_GGUF)
    out = {"length": [], "type": [], "count": [16, 8], "data_offset": []}   # kv_count, tensor_count
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        starts, pos = [], field.offset
        for part in field.parts:                 # a KV's parts are contiguous, in file order
            starts.append(pos)
            pos += int(part.nbytes)
        out["length"].append(starts[0])          # key length; parts: klen, key, type, value...
        out["type"].append(starts[2])
        if field.types[0] == GGUFValueType.STRING:
            out["length"].append(starts[3])
        elif field.types[0] == GGUFValueType.ARRAY:
            out["type"].append(starts[3])
            out["length"].append(starts[4])      # the array's length
            if field.types[1] == GGUFValueType.STRING:
                out["length"] += starts[5::2][:64]    # some of its strings' lengths
    for t in reader.tensors:
        pos = t.field.offset                     # name length, name, n_dims, dims, type, offset
        name_len = 8 + len(t.name)
        n_dims = len(t.shape)
        out["length"].append(pos)
        out["count"].append(pos + name_len)
        out["type"].append(pos + name_len + 4 + 8 * n_dims)
        out["data_offset"].append(pos + name_len + 4 + 8 * n_dims + 4)
    return out


OFFSETS = _field_offsets()
HEADER_END = max(OFFSETS["data_offset"]) + 8
WIDTH = {"length": 8, "type": 4, "count": 8, "data_offset": 8}


def _width(kind: str, offset: int) -> int:
    return 4 if kind == "count" and offset > 16 else WIDTH[kind]   # n_dims is a u32


def _values(width: int):
    top = 2**(8 * width) - 1
    edges = [v for v in (top, top >> 1, top - 255, 2**32, 2**31) if v <= top]
    return st.one_of(st.integers(0, 64), st.integers(0, len(ORIGINAL) + 64),
                     st.integers(0, top), st.sampled_from(edges))


@st.composite
def corruptions(draw) -> tuple[str, bytes]:
    """(description, corrupted file bytes)."""
    data = bytearray(ORIGINAL)
    kind = draw(st.sampled_from(["length", "type", "count", "data_offset", "truncate",
                                 "flip_header", "flip_any"]))
    if kind == "truncate":
        cut = draw(st.integers(0, len(data) - 1))
        return f"truncated to {cut} bytes", bytes(data[:cut])
    if kind.startswith("flip"):
        end = HEADER_END if kind == "flip_header" else len(data)
        flips = draw(st.lists(st.tuples(st.integers(0, end - 1), st.integers(0, 255)),
                              min_size=1, max_size=8))
        for off, byte in flips:
            data[off] = byte
        return f"bytes set {flips}", bytes(data)
    off = draw(st.sampled_from(OFFSETS[kind]))
    width = _width(kind, off)
    value = draw(_values(width))
    data[off:off + width] = value.to_bytes(width, "little")
    return f"{kind} at byte {off} set to {value}", bytes(data)


def test_unmodified_file_loads(worker):
    assert worker.load(STORIES_GGUF)["result"] == "loaded"


def test_scores_array_length_finding(worker, scratch):
    """Issue 26, finding 6: tokenizer.ggml.scores' array length (the u64 at byte 7072) with
    bytes 7073.. set to 0xFF made gguf-py's reader loop for ever, its memory growing."""
    data = bytearray(ORIGINAL)
    assert struct.unpack_from("<Q", data, 7072)[0] == 512        # the scores array's length
    data[7073:7080] = b"\xff" * 7
    scratch.write_bytes(bytes(data))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        check_gguf(scratch)
    assert time.perf_counter() - t0 < 1.0
    answer = worker.load(scratch)
    assert answer["result"] == "ValueError" and "tokenizer.ggml.scores" in answer["message"]


def test_block_count_beyond_the_tensors(worker, scratch):
    """Found by this file's fuzzing: block_count 0x000A0005 (byte 217 set to 10) made the
    loader list 5.9 million required tensor names (a MemoryError under the worker's cap)."""
    data = bytearray(ORIGINAL)
    assert data[215:219] == (5).to_bytes(4, "little")            # llama.block_count = 5
    data[217] = 10
    scratch.write_bytes(bytes(data))
    answer = worker.load(scratch)
    assert answer["result"] == "ValueError" and "block_count 655365" in answer["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corruptions())
def test_corrupt_file_is_value_error_or_clean_load(worker, scratch, corruption):
    what, data = corruption
    scratch.write_bytes(data)
    answer = worker.load(scratch)
    event(answer["result"])
    assert answer["result"] in ("ValueError", "loaded"), (what, answer)


@pytest.mark.parametrize("kind, offset, value, message", [
    ("length", 24, 2**40, "the key of metadata entry 0"),        # general.architecture's key
    ("type", None, 99, "'general.architecture' has unknown value type 99"),
    ("count", 16, 2**62, "metadata entries"),
    ("count", 8, 2**62, "tensor infos"),
])
def test_header_errors_name_the_field(kind, offset, value, message, scratch):
    data = bytearray(ORIGINAL)
    off = offset if offset is not None else OFFSETS[kind][0]
    width = _width(kind, off)
    data[off:off + width] = value.to_bytes(width, "little")
    scratch.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=message):
        check_gguf(scratch)


def test_tensor_data_past_the_end_names_the_tensor(scratch):
    from gguf import GGUFReader

    tensors = GGUFReader(STORIES_GGUF).tensors
    i = max(range(len(tensors)), key=lambda j: tensors[j].data_offset)      # the last data
    off = OFFSETS["data_offset"][i]
    data = bytearray(ORIGINAL)
    old = struct.unpack_from("<Q", data, off)[0]
    struct.pack_into("<Q", data, off, old + 1024)                 # aligned, 1 KiB too far
    scratch.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"tensor '{tensors[i].name}'.*past the end"):
        check_gguf(scratch)
    struct.pack_into("<Q", data, off, old + 4)                    # not a multiple of 32
    scratch.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="alignment"):
        check_gguf(scratch)


def test_big_endian_file_passes_the_check(tmp_path):
    """A valid file written on a big-endian machine is not refused by the walk."""
    import gguf
    import numpy as np

    path = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_token_list(["a", "bc"])
    w.add_tensor("x", np.arange(64, dtype=np.float32))
    write_out(w)
    check_gguf(path)
    data = bytearray(path.read_bytes())
    data[-1:] = b""                                                # one byte short
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="'x'.*past the end"):
        check_gguf(path)
