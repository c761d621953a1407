"""The disk tier on a full disk (kv/disk_store.py; issue 26, finding 7): a failed write leaves
no temporary file and is counted (`failures`, `bytes_refused`, also in /metrics), writes stop
with one warning while the disk is full and resume when statvfs shows room, stale temporary
files are swept at start, and the engine's outputs stay exact throughout.

A full disk is simulated without root (`FakeDisk`: the store's `open` writes real bytes until
its budget is spent, then raises ENOSPC mid-write, as a full filesystem does; `os.statvfs`
reports the budget left); one test also uses a real 512 KiB tmpfs where mounting is allowed."""
from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.kv import disk_store
from kvserve.kv.block_io import pack_block
from kvserve.kv.disk_store import DiskStore
from kvserve.server.kv_metrics import kv_tier_metrics as _kv_tier_metrics
from tests.kv.test_tiers import make_engine, reference, run, workload

BLOCK = 4096


def tmp_files(root) -> list[Path]:
    return [p for p in Path(root).rglob("*") if ".kvb.tmp" in p.name]


def kvb_files(root) -> list[Path]:
    return [p for p in Path(root).rglob("*.kvb")]


class FakeDisk:
    """`free` bytes left: writes through the store's `open` spend them and fail with ENOSPC
    (after writing what fit) once they are gone; statvfs reports them."""

    def __init__(self, monkeypatch, free: int):
        self.free, self.opened = free, 0
        real_open, real_statvfs = open, os.statvfs
        disk = self

        class Full:
            def __init__(self, f):
                self.f = f

            def write(self, data):
                n = min(len(data), disk.free)
                self.f.write(data[:n])
                disk.free -= n
                if n < len(data):
                    raise OSError(errno.ENOSPC, "No space left on device")
                return n

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

        def fake_open(path, mode="r", *a, **k):
            f = real_open(path, mode, *a, **k)
            if "w" not in mode:
                return f
            disk.opened += 1
            return Full(f)

        def fake_statvfs(path):
            st = real_statvfs(path)
            return os.statvfs_result((st.f_bsize, 1, st.f_blocks, disk.free, disk.free) + tuple(st)[5:])

        monkeypatch.setattr(disk_store, "open", fake_open, raising=False)
        monkeypatch.setattr(disk_store.os, "statvfs", fake_statvfs)


def payloads(n: int, start: int = 0) -> list[tuple[bytes, bytes]]:
    keys = [i.to_bytes(32, "big") for i in range(start, start + n)]
    return [(k, pack_block(k, os.urandom(BLOCK))) for k in keys]


def test_full_disk_leaves_no_temp_files_counts_and_resumes(tmp_path, monkeypatch, caplog):
    disk = FakeDisk(monkeypatch, free=3 * BLOCK + 1000)        # room for three blocks and a bit
    s = DiskStore(str(tmp_path), capacity=64 * 2**20)
    s.FULL_RETRY_S = 0.2
    items = payloads(10)
    with caplog.at_level(logging.WARNING, logger="kvserve.kv.disk_store"):
        s.put_many(items)
        s.flush()
        s.put_many(payloads(10, start=100))                   # while full: refused, not attempted
        s.flush()
    assert tmp_files(tmp_path) == []
    assert len(kvb_files(tmp_path)) == 3 and s.usage()[0] == 3
    assert s.failures == 1 and disk.opened == 4                # the 4th write failed; the rest waited
    size = len(items[0][1])
    assert s.bytes_refused == 17 * size                        # 7 queued + 10 refused at put
    assert [s.get(k) == p for k, p in items[:4]] == [True, True, True, False]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1

    time.sleep(0.3)                                            # back-off over, statvfs: still full
    s.put_many(payloads(2, start=200))
    s.flush()
    assert disk.opened == 4 and s.bytes_refused == 19 * size

    disk.free = 10**9                                          # space returns
    time.sleep(0.3)
    later = payloads(5, start=300)
    s.put_many(later)
    s.flush()
    assert all(s.get(k) == p for k, p in later) and len(kvb_files(tmp_path)) == 8
    assert s.failures == 1 and tmp_files(tmp_path) == []
    s.close()


def test_any_failed_write_removes_its_temp_file(tmp_path, monkeypatch):
    """Not only ENOSPC: an I/O error mid-write also leaves nothing, counts, and does not stop
    later writes."""
    real_open = open
    fail = {"n": 1}

    def flaky_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if "w" in mode and fail["n"]:
            fail["n"] -= 1
            f.write(b"partial")
            f.close()
            raise OSError(errno.EIO, "Input/output error")
        return f

    monkeypatch.setattr(disk_store, "open", flaky_open, raising=False)
    s = DiskStore(str(tmp_path), capacity=2**20)
    s.put_many(payloads(3))
    s.flush()
    assert tmp_files(tmp_path) == [] and s.failures == 1 and len(kvb_files(tmp_path)) == 2
    s.close()


def test_stale_temp_files_are_swept_at_start(tmp_path):
    s = DiskStore(str(tmp_path), capacity=2**20)
    (k, p), = payloads(1)
    s.put_many([(k, p)])
    s.close()
    sub = next(d for d in tmp_path.iterdir() if d.is_dir())
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(done.stdout)                                     # a pid that has exited
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stale = [sub / f"{'ab' * 32}.kvb.tmp{dead}.7", sub / f"{'cd' * 32}.kvb.tmp{os.getpid()}.9"]
        running = sub / f"{'ef' * 32}.kvb.tmp{live.pid}.3"     # a writer still at work
        for f in stale + [running]:
            f.write_bytes(b"half a block")
        s2 = DiskStore(str(tmp_path), capacity=2**20)
        assert s2.swept_tmp_files == 2 and not any(f.exists() for f in stale) and running.exists()
        assert s2.get(k) == p and s2.usage()[0] == 1            # the real block is still indexed
        s2.close()
    finally:
        live.kill()
        live.wait(timeout=10)


def _tier(engine) -> dict:
    return engine.stats().kv_tiers["tiers"][0]


def test_engine_outputs_stay_exact_on_a_full_disk(tmp_path, monkeypatch):
    """Issue 26, finding 7: a 64 MiB tier on a disk with room for a few blocks."""
    root = tmp_path / "kv"
    prompts = workload(7, n=4)
    ref = reference(prompts)
    disk = FakeDisk(monkeypatch, free=40 * 1024)
    eng = make_engine(num_kv_blocks=12, kv_tiers=[f"disk:{root}:64MiB"], kv_tier_reload="always")
    store = eng.kv.connector.stores[0]
    store.FULL_RETRY_S = 0.05
    first = run(eng, prompts)
    again = run(eng, prompts)
    store.flush()
    assert {i: t for i, (t, _) in first.items()} == ref
    assert {i: t for i, (t, _) in again.items()} == ref
    tier = _tier(eng)
    assert tier["failures"] >= 1 and tier["bytes_refused"] > 0 and tmp_files(root) == []
    families = {f.name: f for f in _kv_tier_metrics("m", eng.stats().kv_tiers)}
    assert families["kvserve:kv_tier_bytes_refused"].samples[0].value == tier["bytes_refused"]
    assert families["kvserve:kv_tier_failures"].samples[0].value == tier["failures"]

    on_disk = len(kvb_files(root))
    disk.free = 10**9                                          # space returns: writing resumes
    time.sleep(0.1)
    more = workload(8, n=2)
    assert {i: t for i, (t, _) in run(eng, more).items()} == reference(more)
    eng.shutdown()                                             # flushes the disk tier
    assert len(kvb_files(root)) > on_disk and tmp_files(root) == []
    assert _tier(eng)["failures"] == tier["failures"]


def test_real_small_tmpfs(tmp_path):
    """The finding's setup: a 512 KiB tmpfs under a 64 MiB tier (skipped where mount is not
    allowed)."""
    root = tmp_path / "mnt"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(root)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        prompts = workload(9, n=8, plen=60)          # ~120 blocks of ~5 KiB: over 512 KiB
        eng = make_engine(num_kv_blocks=24, kv_tiers=[f"disk:{root}:64MiB"], kv_tier_reload="always")
        out = run(eng, prompts)
        again = run(eng, prompts)
        tier = _tier(eng)
        eng.shutdown()
        ref = reference(prompts)
        assert {i: t for i, (t, _) in out.items()} == ref
        assert {i: t for i, (t, _) in again.items()} == ref
        assert tier["failures"] >= 1 and tier["bytes_refused"] > 0
        assert tmp_files(root) == []
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
