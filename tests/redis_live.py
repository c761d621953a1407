"""A redis-server of the tests' own on a free loopback port (Debian's `redis-server`).
Without one a test skips, unless KVSERVE_REQUIRE_REDIS=1 (CI, .ci/run): then it fails."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time

import pytest
import redis


@contextlib.contextmanager
def redis_server():
    """Yield (url, process) of a fresh, non-persistent Redis; skip the test without one (fail
    it with KVSERVE_REQUIRE_REDIS=1)."""
    exe = shutil.which("redis-server")
    if exe is None:
        why = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("KVSERVE_REQUIRE_REDIS") == "1":
            pytest.fail(f"{why}, and KVSERVE_REQUIRE_REDIS=1 requires it")
        pytest.skip(why)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}") from None
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server on port {port} did not answer PING in 200 tries (about 10 s)")
        yield f"redis://127.0.0.1:{port}", proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
