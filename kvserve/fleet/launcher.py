"""Data-parallel replicas: N `kvserve serve` processes with the same engine flags, each on a free
port, started here (`LocalReplicas`) or as Ray actors (`RayReplicas`), for the router in front
(fleet/router.py; seed 003, "Radix trees": replicas of one model behind a prefix-aware router).

A replica is a whole `kvserve serve` -- HTTP server, engine process, its own KV cache -- so the
router talks to it over the same OpenAI API a client would, and a replica that dies takes
nothing else with it. Local replicas run in a session of their own (a replica and its engine
process are stopped together, by process group) and get SIGTERM if the launcher dies
(PR_SET_PDEATHSIG), so none outlives `kvserve serve --data-parallel-size N`.

Under Ray (`--distributed-executor-backend ray`) each replica is a `ServeReplica` actor that runs
the same `kvserve serve` on the node Ray placed it on, bound to loopback when that is the
launcher's node and to the node's address otherwise; `ray.init` joins `$RAY_ADDRESS` (a cluster
from `ray start --head`) or starts a local instance, which is shut down with the replicas.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1

# Server flags each replica gets its own value of (spawn_server), not the launcher's.
LAUNCHER_DESTS = {"host", "port"}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The flags of `parser` (one server's: server/cli.py) whose values in `args` differ from
    their defaults, as a command line: what every replica is started with. Flags `parser` lacks
    (data parallelism, the router's) and --host/--port are left out."""
    out: list[str] = []
    for a in parser._actions:
        if a.dest in LAUNCHER_DESTS or not a.option_strings or not hasattr(args, a.dest):
            continue
        value = getattr(args, a.dest)
        if value == a.default:
            continue
        opt = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
        if isinstance(a, argparse.BooleanOptionalAction):
            out.append(opt if value else "--no-" + opt[2:])
        elif isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(opt)
        elif isinstance(value, (list, tuple)):
            out += [opt, *map(str, value)]
        elif value is not None:
            out += [opt, str(value)]
    return out


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):       # not Linux: stop() still stops it
        pass


def spawn_server(argv: list[str], host: str, port: int, env: dict | None = None,
                 log_path: str | None = None) -> subprocess.Popen:
    """`kvserve serve ARGV --host HOST --port PORT` in a session of its own."""
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *argv, "--host", host, "--port", str(port)]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
    full_env.update(env or {})
    out = open(log_path, "ab") if log_path else None
    try:
        return subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True, preexec_fn=_die_with_parent)
    finally:
        if out is not None:
            out.close()


def stop_server(proc: subprocess.Popen, timeout: float = 30.0, sig: int = signal.SIGTERM) -> int:
    """Signal the replica's process group; SIGKILL it after `timeout` seconds."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the engine process of a replica that was killed outright
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


def wait_healthy(urls: list[str], alive=lambda i: True, timeout: float = 300.0) -> None:
    """Until every replica's /health answers 200; RuntimeError if one exits or time runs out."""
    pending = set(range(len(urls)))
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while pending:
            for i in sorted(pending):
                if not alive(i):
                    raise RuntimeError(f"replica {i} ({urls[i]}) exited during startup; its log says why")
                try:
                    if client.get(urls[i] + "/health").status_code == 200:
                        pending.discard(i)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {[urls[i] for i in sorted(pending)]} were not healthy "
                                   f"within {timeout:.0f} s")
            if pending:
                time.sleep(0.2)


class LocalReplicas:
    """N local `kvserve serve` subprocesses on free loopback ports."""

    def __init__(self, n: int, argv: list[str], host: str = "127.0.0.1", env: dict | None = None,
                 log_dir: str | None = None):
        self.host = host
        self.ports = [free_port(host) for _ in range(n)]
        self.procs = [spawn_server(argv, host, p, env,
                                   os.path.join(log_dir, f"replica-{i}.log") if log_dir else None)
                      for i, p in enumerate(self.ports)]

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{p}" for p in self.ports]

    def wait_healthy(self, timeout: float = 300.0) -> None:
        wait_healthy(self.urls, lambda i: self.procs[i].poll() is None, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs:            # all at once, then wait for each
            if p.poll() is None:
                with suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            stop_server(p, timeout)


def _streams_kv_in(argv: list[str]) -> bool:
    """A `--kv-role decode --kv-transfer stream` replica's command line."""
    pairs = set(zip(argv, argv[1:]))
    return bool({("--kv-role", "decode"), ("--role", "decode")} & pairs) and ("--kv-transfer", "stream") in pairs


class ServeReplica:
    """A Ray actor running one `kvserve serve` on its node (decorated in `RayReplicas`)."""

    def __init__(self, argv: list[str], driver_node_id: str, env: dict):
        import ray

        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        local = ctx.get_node_id() == driver_node_id
        self.host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.port = free_port(self.host)
        # A replica's own Ray use (tensor-parallel workers) joins this cluster, not a new one.
        env = {"RAY_ADDRESS": ctx.gcs_address, **env}
        if _streams_kv_in(argv) and "--kv-stream-address" not in argv:    # PD decode: reachable from
            argv = [*argv, "--kv-stream-address", f"{self.host}:0"]       # the prefill pool's nodes
        self.proc = spawn_server(argv, self.host, self.port, env)

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def node(self) -> str:
        return self.node_id

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int | None:
        return stop_server(self.proc, timeout)


class RayReplicas:
    """N replicas as Ray actors, `num_cpus` each (0 places them regardless of CPU count).

    With a placement `strategy` (config/placement.py) each replica is a placement group of
    `ranks` bundles of `num_cpus` CPUs (tensor x pipeline parallel size): the replica's actor
    in bundle 0, its workers (distributed/executor.py) in bundles 1..ranks-1."""

    def __init__(self, n: int, argv: list[str], env: dict | None = None, num_cpus: float = 1.0,
                 strategy: str | None = None, ranks: int = 1):
        try:
            import ray
        except ImportError as e:
            raise ValueError("--distributed-executor-backend ray needs Ray: pip install ray") from e
        if strategy is not None and num_cpus <= 0:
            raise ValueError("--ray-placement-strategy reserves --ray-replica-num-cpus CPUs per rank: "
                             "give it a value above 0 (a fraction is fine)")
        self.ray = ray
        self.groups: list = []
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            # "local": a fresh instance of our own, never someone else's that happens to run here
            ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False,
                     log_to_driver=False, namespace=f"kvserve-{os.getpid()}")
        driver = ray.get_runtime_context().get_node_id()
        actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(ServeReplica)
        options = [{} for _ in range(n)]
        envs = [dict(env or {}) for _ in range(n)]
        if strategy is not None:
            options, envs = self._place(n, ranks, num_cpus, strategy, envs)
        self.actors = [actor_cls.options(**o).remote(argv, driver, e) for o, e in zip(options, envs)]
        try:
            self.url_list = ray.get([a.url.remote() for a in self.actors], timeout=300)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise RuntimeError(f"Ray did not place {n} replicas of {num_cpus} CPUs each within 300 s "
                               f"(cluster resources: {ray.cluster_resources()})") from None

    def _place(self, n: int, ranks: int, num_cpus: float, strategy: str, envs: list[dict]):
        """One placement group per replica, ready; the actors' options and environments."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvserve.config.placement import GROUP_ENV, NAMESPACE_ENV, RANK_CPUS_ENV

        ray = self.ray
        tag = f"kvserve-{os.getpid()}-{time.monotonic_ns()}"
        names = [f"{tag}-replica-{i}" for i in range(n)]
        self.groups = [placement_group([{"CPU": num_cpus}] * ranks, strategy=strategy, name=name)
                       for name in names]
        try:
            ray.get([g.ready() for g in self.groups], timeout=300)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise RuntimeError(f"Ray could not place {n} replicas of {ranks} ranks x {num_cpus} CPUs "
                               f"({strategy}) within 300 s (cluster resources: "
                               f"{ray.cluster_resources()})") from None
        namespace = ray.get_runtime_context().namespace
        options = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=0)}
                   for g in self.groups]
        envs = [{**e, GROUP_ENV: name, NAMESPACE_ENV: namespace, RANK_CPUS_ENV: str(num_cpus)}
                for e, name in zip(envs, names)]
        return options, envs

    def nodes(self) -> list[str]:
        """The Ray node id each replica's actor (and rank 0) runs on."""
        return self.ray.get([a.node.remote() for a in self.actors], timeout=60)

    @property
    def urls(self) -> list[str]:
        return list(self.url_list)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        def alive(i: int) -> bool:
            try:
                return self.ray.get(self.actors[i].alive.remote(), timeout=10)
            except Exception:   # noqa: BLE001  (a dead actor is a dead replica)
                return False

        wait_healthy(self.urls, alive, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        ray = self.ray
        try:
            ray.get([a.stop.remote(timeout) for a in self.actors], timeout=timeout + 10)
        except Exception:   # noqa: BLE001  (actors already gone)
            pass
        for a in getattr(self, "actors", []):
            with suppress(Exception):
                ray.kill(a)
        for g in self.groups:
            with suppress(Exception):
                ray.util.remove_placement_group(g)
        if self.started_ray:
            ray.shutdown()
