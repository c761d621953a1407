"""The kernels' build cache (issue 33, item 6): keyed by the sources' text, torch and the CPU,
not by the checkout's path. A second checkout with the same sources loads the first one's build
without compiling (the sources are copied into the cache, so ninja sees the same paths), and
the first build says so in the log, once."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.isa import BUILT

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
import kvserve.kernels as k
assert k.load(), "no build"
print("FROM", k.__file__)
"""


def load_from(tree: Path, cache: Path) -> str:
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tree, capture_output=True, text=True, timeout=600,
                       env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "KVSERVE_KERNEL_CACHE": str(cache), "PYTHONPATH": str(tree),
                            "HOME": str(cache)})
    assert p.returncode == 0, p.stderr
    assert f"FROM {tree}/kvserve/kernels/__init__.py" in p.stdout
    return p.stderr


@pytest.mark.skipif(not BUILT, reason="kvserve's kernels do not build here")
def test_a_second_checkout_reuses_the_build(tmp_path):
    other = tmp_path / "other-checkout"
    shutil.copytree(ROOT / "kvserve", other / "kvserve", ignore=shutil.ignore_patterns("__pycache__"))
    cache = tmp_path / "cache"
    first = load_from(ROOT, cache)
    assert "building kvserve's CPU kernels" in first and "built kvserve's CPU kernels in" in first
    (build,) = [d for d in cache.iterdir() if d.is_dir()]
    so = build / "kvserve_kernels.so"
    made = so.stat().st_mtime_ns
    second = load_from(other, cache)
    assert "building" not in second and so.stat().st_mtime_ns == made     # nothing compiled, nothing linked
    assert [d.name for d in cache.iterdir() if d.is_dir()] == [build.name]
    ninja = (build / "build.ninja").read_text()
    assert str(build / "src") in ninja and str(ROOT / "kvserve") not in ninja and str(other) not in ninja


@pytest.mark.skipif(not BUILT, reason="kvserve's kernels do not build here")
def test_concurrent_first_starts_build_once(tmp_path):
    cache = tmp_path / "cache"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "KVSERVE_KERNEL_CACHE": str(cache),
           "PYTHONPATH": str(ROOT), "HOME": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    logs = [p.communicate(timeout=600)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sum("building kvserve's CPU kernels" in log for log in logs) == 1, logs


def test_the_compiler_flags_are_part_of_the_key(monkeypatch, tmp_path):
    """A build made with other flags (kernels.CFLAGS: -fno-trapping-math is what lets gcc
    vectorise exp) is never loaded for these."""
    import kvserve.kernels as k
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    now = k._build_dir()
    monkeypatch.setattr(k, "CFLAGS", [f for f in k.CFLAGS if f != "-fno-trapping-math"])
    assert k._build_dir() != now and k._build_dir().parent == now.parent
