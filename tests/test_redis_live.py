"""tests/redis_live.py: without redis-server the Redis tests skip on a developer's machine and
fail in CI (KVSERVE_REQUIRE_REDIS=1, set by .ci/run)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.redis_live import redis_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("required,outcome", [(None, pytest.skip.Exception), ("1", pytest.fail.Exception)])
def test_missing_redis_server_skips_or_fails(monkeypatch, tmp_path, required, outcome):
    monkeypatch.setenv("PATH", str(tmp_path))                   # no redis-server on it
    if required is None:
        monkeypatch.delenv("KVSERVE_REQUIRE_REDIS", raising=False)
    else:
        monkeypatch.setenv("KVSERVE_REQUIRE_REDIS", required)
    with pytest.raises(outcome, match="redis-server is not installed"):
        with redis_server():
            pass


def test_ci_stops_without_redis_server(tmp_path):
    """.ci/run, copied into an empty tree, with a PATH where apt-get fails and no redis-server:
    it exits 1 naming redis-server before it creates a venv."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("dirname",):
        (bin_ / tool).symlink_to(shutil.which(tool))
    (bin_ / "apt-get").write_text("#!/bin/sh\nexit 100\n")
    (bin_ / "apt-get").chmod(0o755)
    r = subprocess.run([shutil.which("bash"), str(tmp_path / ".ci" / "run")], env={"PATH": str(bin_)},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "could not install redis-server" in r.stderr, (r.returncode, r.stderr)
    assert not (tmp_path / ".venv").exists()
    assert "export KVSERVE_REQUIRE_REDIS=1" in (ROOT / ".ci" / "run").read_text()
