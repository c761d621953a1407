"""A debug probe of what a long-running process holds (benchmarks/soak.py's `--probe`).

With `KVSERVE_MEMORY_PROBE=DIR` set, `start(role, roots)` starts a daemon thread that appends one
JSON line to DIR/<role>-<pid>.jsonl every `KVSERVE_MEMORY_PROBE_S` seconds (15):

    rss / anon      the process's resident and anonymous resident KiB (/proc/self/status)
    malloc          glibc's mallinfo2: bytes in use (`used`), free but kept (`free`), mmapped
    py_blocks       sys.getallocatedblocks() (Python's small-object allocator)
    types           live gc-tracked objects by type (objects frozen by gc.freeze() are not
                    counted: after the engine core's freeze, only what was made since)
    sizes           len() of every container reachable from `roots` through the attributes of
                    kvserve objects (a path such as `engine.scheduler.kv.block_tables`), of
                    kvserve modules' global containers, and the `currsize` of their lru_caches
    tracemalloc     with KVSERVE_MEMORY_PROBE_TRACEMALLOC=1: the 25 allocation sites that grew
                    most since the first record (slow: every allocation is traced)

Without the variable nothing starts. Nothing here changes what the process does; the walk reads
attributes under the GIL, as any other thread would.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import weakref

ENV = "KVSERVE_MEMORY_PROBE"
_CONTAINERS = (dict, list, set, frozenset, collections.deque, weakref.WeakKeyDictionary,
               weakref.WeakValueDictionary, weakref.WeakSet)
MAX_DEPTH = 6


def start(role: str, roots: dict) -> threading.Thread | None:
    """Start the probe thread when KVSERVE_MEMORY_PROBE names a directory; None otherwise."""
    out_dir = os.environ.get(ENV)
    if not out_dir:
        return None
    interval = float(os.environ.get(ENV + "_S", "15"))
    traced = os.environ.get(ENV + "_TRACEMALLOC") == "1"
    if traced:
        import tracemalloc
        tracemalloc.start(int(os.environ.get(ENV + "_FRAMES", "1")))
    path = os.path.join(out_dir, f"{role}-{os.getpid()}.jsonl")
    holder = {"roots": {k: weakref.ref(v) if _weakrefable(v) else (lambda v=v: v) for k, v in roots.items()}}

    def loop() -> None:
        baseline = None
        while True:
            try:
                rec = record({k: r() for k, r in holder["roots"].items()})
                if traced:
                    import tracemalloc
                    snap = tracemalloc.take_snapshot().filter_traces(
                        [tracemalloc.Filter(False, tracemalloc.__file__)])
                    if baseline is None:
                        baseline = snap
                    rec["tracemalloc"] = [
                        {"where": str(s.traceback[0]), "size_kib": round(s.size / 1024, 1),
                         "grew_kib": round(s.size_diff / 1024, 1), "count": s.count, "grew": s.count_diff}
                        for s in snap.compare_to(baseline, "lineno")[:25]]
                with open(path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            except Exception as e:  # noqa: BLE001 -- a probe must never take its process down
                with open(path, "a") as f:
                    f.write(json.dumps({"t": time.time(), "error": f"{type(e).__name__}: {e}"}) + "\n")
            time.sleep(interval)

    t = threading.Thread(target=loop, name="kvserve-memory-probe", daemon=True)
    t.start()
    return t


def _weakrefable(v) -> bool:
    try:
        weakref.ref(v)
        return True
    except TypeError:
        return False


def record(roots: dict) -> dict:
    """One record (the module docstring's fields) of this process now."""
    types: collections.Counter = collections.Counter()
    for o in gc.get_objects():
        t = type(o)
        types[f"{t.__module__}.{t.__qualname__}"] += 1
    return {"t": time.time(), "pid": os.getpid(), **_status(), "malloc": _mallinfo(),
            "py_blocks": sys.getallocatedblocks(), "gc_objects": sum(types.values()),
            "types": {k: v for k, v in types.items() if v >= 20}, "sizes": sizes(roots)}


def sizes(roots: dict) -> dict[str, int]:
    """len() of the containers reachable from `roots` (see the module docstring)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    todo = [(name, obj, 0) for name, obj in roots.items() if obj is not None]
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("kvserve") and mod is not None:
            todo.append((mod_name, mod, MAX_DEPTH - 1))     # module globals, one level down
    while todo:
        path, obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            items = list(vars(obj).items())
        except TypeError:
            items = [(s, getattr(obj, s)) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)]
        for name, v in items:
            if name.startswith("__"):
                continue
            p = f"{path}.{name}"
            if isinstance(v, _CONTAINERS):
                try:
                    out[p] = len(v)
                except Exception:  # noqa: BLE001
                    pass
                if isinstance(v, dict) and depth < MAX_DEPTH:   # one kvserve value per dict, as a sample
                    try:
                        first = next(iter(v.values()), None)
                    except RuntimeError:            # changed meanwhile: skip it this time
                        first = None
                    if first is not None and _ours(first):
                        todo.append((p + "[*]", first, depth + 1))
            elif hasattr(v, "cache_info") and callable(v.cache_info):
                try:
                    out[p + ".cache_info"] = v.cache_info().currsize
                except Exception:  # noqa: BLE001
                    pass
            elif depth < MAX_DEPTH and _ours(v):
                todo.append((p, v, depth + 1))
    return out


def _ours(v) -> bool:
    """A kvserve object (or a thread pool or queue, whose sizes matter too): walked into."""
    mod = type(v).__module__ or ""
    return not isinstance(v, type) and (mod.startswith("kvserve") or mod in ("concurrent.futures.thread", "queue"))


def _status() -> dict:
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_kib": int(fields["VmRSS"].split()[0]), "anon_kib": int(fields["RssAnon"].split()[0]),
                "threads": int(fields["Threads"])}
    except (OSError, KeyError, ValueError):
        return {}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_mallinfo2 = None


def _mallinfo() -> dict:
    """glibc's heap: in use, free but kept by the allocator, mmapped; {} off glibc."""
    global _mallinfo2
    if _mallinfo2 is None:            # once: a CDLL a record would be objects of its own
        try:
            _mallinfo2 = ctypes.CDLL(None).mallinfo2
            _mallinfo2.restype = _MallInfo2
        except (OSError, AttributeError):
            _mallinfo2 = False
    if not _mallinfo2:
        return {}
    m = _mallinfo2()
    return {"used_kib": m.uordblks // 1024, "free_kib": m.fordblks // 1024, "mmapped_kib": m.hblkhd // 1024,
            "arena_kib": m.arena // 1024}
