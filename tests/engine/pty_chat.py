"""`kvserve chat` on a pseudo-terminal, for the tests that press Ctrl-C during an answer."""
from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class PtyChat:
    """`python -m kvserve.cli chat *args` in a child on a pseudo-terminal; use as a context
    manager, which kills a child still running at the end. `buf` is everything it wrote."""

    def __init__(self, *args: str, env: dict | None = None, poll_s: float = 0.1):
        self.buf, self.status, self.poll_s = bytearray(), None, poll_s
        self.pid, self.fd = pty.fork()
        if self.pid == 0:       # the child
            os.chdir(ROOT)
            os.environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
            os.execv(sys.executable, [sys.executable, "-m", "kvserve.cli", "chat", *args])

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def read_until(self, marker: bytes, start: int, timeout: float = 120.0) -> int:
        """The offset just past the first `marker` at or after `start`, read as it comes."""
        deadline = time.monotonic() + timeout
        while marker not in self.buf[start:]:
            assert time.monotonic() < deadline, f"no {marker!r} in {bytes(self.buf)!r}"
            if select.select([self.fd], [], [], self.poll_s)[0]:
                try:
                    self.buf.extend(os.read(self.fd, 4096))
                except OSError:                               # EIO: the child has exited
                    raise AssertionError(f"kvserve chat ended early: {bytes(self.buf)!r}") from None
        return self.buf.index(marker, start) + len(marker)

    def exit_code(self) -> int:
        """Send /exit and wait for the child."""
        self.write(b"/exit\n")
        _, self.status = os.waitpid(self.pid, 0)
        return os.waitstatus_to_exitcode(self.status)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
