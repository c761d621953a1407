"""A redis-server of the tests' own on a free loopback port (Debian's `redis-server`)."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time

import pytest


@contextlib.contextmanager
def redis_server():
    """Yield (url, process) of a fresh, non-persistent Redis; skip the test without one."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}", proc
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)
