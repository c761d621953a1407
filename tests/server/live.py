"""Start `kvserve serve` in a subprocess on 127.0.0.1 and a free port; stop it afterwards."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
STORIES_HF = ROOT.parent / "shared" / "models" / "stories260K-hf"


@contextlib.contextmanager
def reference_llm():
    """An in-process `LLM` on the same model, run on one thread like the server subprocess
    (OMP_NUM_THREADS=1): the same arithmetic, and no fight over two cores with the server."""
    import torch

    from kvserve import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(model=str(STORIES_HF))
    finally:
        torch.set_num_threads(threads)


def openai_client(server: "LiveServer"):
    """The official SDK against `server`: no retries, no proxy from the environment."""
    import openai
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120,
                         http_client=httpx.Client(trust_env=False, timeout=120))


def long_stories(out_dir: Path, max_positions: int = 4096) -> Path:
    """stories260K with its position limit raised from 512 (same weights, RoPE runs past its
    training length): a request that holds a seat for seconds, not the ~0.4 s that 480 tokens
    take, so a test that must act while a request runs has that long to do it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in STORIES_HF.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    cfg = json.loads((STORIES_HF / "config.json").read_text())
    cfg["max_position_embeddings"] = max_positions
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_key(args: tuple, env: dict) -> str | None:
    """A key the server accepts: --api-key's, $KVSERVE_API_KEY, or the first of --api-keys FILE."""
    args = list(args)
    if "--api-key" in args:
        return args[args.index("--api-key") + 1]
    if env.get("KVSERVE_API_KEY"):
        return env["KVSERVE_API_KEY"]
    if "--api-keys" in args:
        path = Path(args[args.index("--api-keys") + 1])
        text = path.read_text()
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        return next(iter(data.get("keys", data)))
    return None


class LiveServer:
    def __init__(self, *extra_args: str, env: dict | None = None, startup_timeout: float = 90.0,
                 model: Path = STORIES_HF):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = _server_key(extra_args, {**os.environ, **(env or {})})   # for /metrics
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *extra_args]
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_PROXY="*")
        full_env.update(env or {})
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvserve-test-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvserve serve did not become healthy:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as {'name{labels}': value}, and {'name': value} summed over labels."""
        headers = {"Authorization": b"Bearer " + self.api_key.encode()} if self.api_key else {}
        r = httpx.get(self.base_url + "/metrics", headers=headers, timeout=10, trust_env=False)
        r.raise_for_status()
        text = r.text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
            name = key.split("{", 1)[0]
            if "{" in key:
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def wait_for(self, what: str, pred, timeout: float = 10.0, interval: float = 0.01) -> dict[str, float]:
        """Poll /metrics until `pred(metrics)` holds; AssertionError naming `what` after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if pred(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not seen within {timeout} s; metrics: "
                                     f"{ {k: v for k, v in m.items() if '{' not in k} }")
            time.sleep(interval)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once nothing runs or waits and every KV block is back in the pool (the engine
        loop publishes its stats after a step, so a client can read its last chunk first)."""
        return self.wait_for("an idle server (no request running or waiting, every KV block free)",
                             lambda m: m["kvserve:num_requests_running"] == 0 and
                             m["kvserve:num_requests_waiting"] == 0 and
                             m["kvserve:num_kv_blocks_free"] == m["kvserve:num_kv_blocks_total"], timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode == 0:
            self.log_path.unlink(missing_ok=True)     # kept only when something went wrong
        return self.proc.returncode
