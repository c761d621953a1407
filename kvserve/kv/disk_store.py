"""The disk tier (seed 003, "Tiers of KV storage": "then local SSDs"): one file per block
payload under a directory (`<dir>/<hh>/<hash hex>.kvb`), written by a background thread
(a temporary file, then an atomic rename), LRU by file time and bounded in bytes.

- Restarts: the directory is scanned at start, so a restarted server hits on what it served
  before; temporary files whose writer no longer runs (a crash mid-write) are removed then.
- Failed writes leave no file: the temporary one is removed, the block becomes a miss, and the
  store counts it (`failures`, `bytes_refused`: in engine.stats().kv_tiers and /metrics).
- A full disk (ENOSPC, EDQUOT): writes stop, with one warning, and what would be written is
  refused and counted; every FULL_RETRY_S seconds `statvfs` is asked, and writing resumes when
  it shows room. Reads go on all along.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections import OrderedDict

from kvserve.kv.tier_store import WrittenInBackground

log = logging.getLogger(__name__)


class DiskStore(WrittenInBackground):
    """One file per block under `root`, written in the background, LRU by file time."""

    kind = "disk"
    write_through = True
    SUFFIX = ".kvb"
    TMP = re.compile(r"\.kvb\.tmp(\d+)\.\d+$")     # <hash hex>.kvb.tmp<pid>.<thread id>
    FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
    FULL_RETRY_S = 5.0       # a full disk is asked again (statvfs) after this long

    def __init__(self, root: str, capacity: int, name: str | None = None):
        super().__init__(name or f"disk:{root}")
        self.root = os.path.abspath(root)
        self.capacity = capacity
        os.makedirs(self.root, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()    # key -> file size, oldest first
        self._pending: dict[bytes, bytes] = {}                   # queued, not yet on disk
        self.nbytes = 0
        self.failures = 0
        self.bytes_refused = 0
        self.swept_tmp_files = 0
        self._full_until: float | None = None    # monotonic time of the next statvfs; None: not full
        self._full_warned = False                 # one warning per full spell, until a write succeeds
        self._scan()
        self._start_writer("kv-disk-writer")

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, h[:2], h + self.SUFFIX)

    def _scan(self) -> None:
        """Index the files a previous run left (a restart keeps its hits), oldest first; remove
        the temporary files whose writer is gone (a crash or a failed write of an older run)."""
        found = []
        for sub in os.scandir(self.root):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                m = self.TMP.search(f.name)
                if m and _writer_gone(int(m.group(1))):
                    self.swept_tmp_files += _remove(f.path)
                elif f.name.endswith(self.SUFFIX):
                    try:
                        st = f.stat()
                        found.append((st.st_mtime, bytes.fromhex(f.name[:-len(self.SUFFIX)]), st.st_size))
                    except (OSError, ValueError):
                        continue
        for _, key, size in sorted(found):
            self._index[key] = size
            self.nbytes += size
        if self.swept_tmp_files:
            log.info("kv disk tier %s: removed %d stale temporary files", self.root, self.swept_tmp_files)

    def _disk_full(self, nbytes: int) -> bool:
        """Whether writes are refused (lock held): after a full-disk error, until FULL_RETRY_S
        has passed and statvfs shows room for `nbytes`."""
        if self._full_until is None:
            return False
        now = time.monotonic()
        if now < self._full_until:
            return True
        try:
            st = os.statvfs(self.root)
            room = st.f_bavail * st.f_frsize
        except OSError:
            room = 0
        if room < nbytes:
            self._full_until = now + self.FULL_RETRY_S
            return True
        self._full_until = None
        return False

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            try:
                if key is None:
                    return
                self._write(key)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes) -> None:
        """Write one queued payload: a temporary file renamed into place, or, on any error, no
        file at all (the temporary one removed; the block is a miss later)."""
        with self._lock:
            payload = self._pending.get(key)
            if payload is not None and self._disk_full(len(payload)):
                self._forget(key)
                self.bytes_refused += len(payload)
                return
        if payload is None:
            return
        path = self._path(key)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(payload)
            with self._lock:
                if self._pending.get(key) is payload:     # not evicted meanwhile
                    os.replace(tmp, path)
                    del self._pending[key]
                    if self._full_warned:
                        self._full_warned = False
                        log.info("kv disk tier %s: space returned, writing resumed", self.root)
                    return
            _remove(tmp)                                   # evicted while it was written
        except OSError as e:
            _remove(tmp)
            with self._lock:
                self._forget(key)
                self.failures += 1
                self.bytes_refused += len(payload)
                if e.errno in self.FULL_ERRNOS:
                    self._full_until = time.monotonic() + self.FULL_RETRY_S
                    if not self._full_warned:
                        self._full_warned = True
                        log.warning("kv disk tier %s: the disk is full (%s); writes stop until "
                                    "statvfs shows space (asked every %.0f s)", self.root, e,
                                    self.FULL_RETRY_S)

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
                if self._disk_full(len(payload)):
                    self.bytes_refused += len(payload)
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
            _remove(self._path(key))
        return []

    def delete(self, key):
        with self._lock:
            self._forget(key)
        _remove(self._path(key))

    def usage(self):
        with self._lock:
            return len(self._index), self.nbytes


def _remove(path: str) -> bool:
    """Unlink `path`; False (no error) if it was not there or could not be removed."""
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def _writer_gone(pid: int) -> bool:
    """Whether the process that named a temporary file `pid` no longer runs (or is this one:
    a previous run under the same pid)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:          # EPERM: it runs, as another user
        return False
    return False
