"""Executors for tensor and pipeline parallelism: rank 0 (the driver) runs in the engine's process,
ranks 1..N-1 run as workers -- local processes (`distributed_executor_backend="mp"`) or Ray actors
("ray"), with the same worker code. A rank is a tensor-parallel slice of every layer, or a
pipeline stage holding some of the layers (pipeline.py: the stages pass the residual stream on
and the last sends the logits back to rank 0); the rest below holds for both.

The scheduler runs once, on the driver. Every step's SchedulerOutput (worker/scheduler_output.py:
the step as data, each sequence's tokens sent once, then deltas) and every block move (copy on
write, swap) the driver's runner makes is first broadcast to the workers (`broadcast_object_list`
over a gloo group; on CUDA rank r owns device r); every rank then packs its own inputs from its
own copy of the sequences and runs its slice of the same pass, meeting at the all-reduces of
kvserve/distributed/tensor_parallel.py; rank 0 alone samples. Workers keep no scheduling state:
each has a `ModelRunner` over its slice of the model and its own KV pools, with the driver's
block numbering.

A worker that dies is noticed before the next broadcast (mp: its process sentinel) or by the
collective itself (its peer's connection closes; every collective has a deadline,
COLLECTIVE_TIMEOUT): the step raises, which fails the engine's requests, and the server reports
unhealthy. Nothing waits for ever.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing
import os
import socket

import torch
import torch.distributed as dist

from kvserve.config.placement import GROUP_ENV, NAMESPACE_ENV, RANK_CPUS_ENV
from kvserve.distributed.pipeline import PipelineStage
from kvserve.distributed.tensor_parallel import bind_rank_device, rank_device
from kvserve.worker.build import build_model
from kvserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, size: int, init_method: str, device: torch.device):
    """Join the model's group (NCCL on CUDA, else gloo); returns the gloo group of the messages."""
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)


def _recv(group):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def run_worker(config, rank: int, size: int, init_method: str) -> None:
    """A worker's life: build its slice of the model, or its pipeline stage (`config`: the engine's
    resolved Config), join the group, then run what rank 0 sends."""
    torch.set_num_threads(threads_per_rank(size))
    device = bind_rank_device(config.model.device, rank)
    if config.parallel.pipeline_parallel_size > 1:
        model = build_model(config.model, config.cache.block_size, config.cache.kv_cache_dtype, device,
                            pp_rank=rank, pp_size=size).model
        model = PipelineStage(model, model.stage, config.parallel.pipeline_micro_batches)
    else:
        model = build_model(config.model, config.cache.block_size, config.cache.kv_cache_dtype, device,
                            rank=rank, tp_size=size, expert_parallel=config.parallel.enable_expert_parallel).model
    group = _init_group(rank, size, init_method, device)
    try:
        _, num_blocks, num_cpu_blocks = _recv(group)
        runner = ModelRunner(model, num_blocks, config.cache.block_size)
        runner.init_swap_space(num_cpu_blocks)
        while True:
            msg = _recv(group)
            if msg[0] == "step":
                _, sampled, so = msg
                for sid, tokens in sampled.items():     # what rank 0 sampled last step
                    if sid in runner.states:
                        runner.states[sid].token_ids.extend(tokens)
                runner.execute_model(so, sample=False)
            elif msg[0] == "kv_ops":
                runner.apply_kv_ops(msg[1])
            else:
                break
    finally:
        dist.destroy_process_group()


class Workers:
    """Ranks 1..N-1, started on `backend` ("mp" or "ray"); rank 0 joins the group here."""

    def __init__(self, config, size: int, backend: str = "mp"):
        """`config`: the engine's resolved Config (config/resolved.py), sent to every worker."""
        self.size, self.backend = size, backend
        pp = getattr(getattr(config, "parallel", None), "pipeline_parallel_size", 1) > 1
        self.kind = "pipeline stage" if pp else "tensor-parallel worker"     # (the errors' words)
        rank_device(config.model.device, size - 1)        # one CUDA device per rank, checked before any start
        host = _ray_node_ip() if backend == "ray" else "127.0.0.1"    # where the other ranks reach rank 0
        init_method = f"tcp://{host}:{_free_port()}"
        self.procs, self.actors = [], []
        if backend == "mp":
            ctx = multiprocessing.get_context("spawn")
            for rank in range(1, size):
                p = ctx.Process(target=run_worker, args=(config, rank, size, init_method),
                                name=f"kvserve-tp-worker-{rank}", daemon=True)
                p.start()
                self.procs.append(p)
        elif backend == "ray":
            self.actors = _start_ray_workers(config, size, init_method)
        else:
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}.")
        torch.set_num_threads(threads_per_rank(size))
        self.group = _init_group(0, size, init_method, bind_rank_device(config.model.device, 0))
        self.closed = False
        atexit.register(self.close)

    def check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RuntimeError(f"{self.kind} {rank} died (exit code {p.exitcode}); "
                                   "the engine cannot run its forward pass")

    def broadcast(self, msg) -> None:
        if self.closed:
            raise RuntimeError(f"the {self.kind}s were shut down")
        self.check_alive()
        try:
            dist.broadcast_object_list([msg], src=0, group=self.group)
        except Exception:
            # a worker killed just before the broadcast is not reaped yet when check_alive runs,
            # and the collective fails instead: name the dead worker if it is one
            for p in self.procs:
                p.join(1.0)
            self.check_alive()
            raise

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if getattr(self, "closed", True):
            return
        self.closed = True
        try:
            self.check_alive()
            dist.broadcast_object_list([("stop",)], src=0, group=self.group)
        except Exception:  # noqa: BLE001 -- a dead worker: kill the rest below
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        for a in self.actors:
            _ray_kill(a)
        if dist.is_initialized():
            dist.destroy_process_group()


class DriverRunner(ModelRunner):
    """Rank 0's runner: every forward pass and block move goes to the workers first."""

    def __init__(self, model, num_blocks: int, block_size: int, workers: Workers):
        super().__init__(model, num_blocks, block_size)
        self.workers, self.num_blocks = workers, num_blocks
        self._sampled: dict[str, list[int]] = {}      # seq id -> tokens sampled last step, for the ranks

    def init_swap_space(self, num_cpu_blocks: int) -> None:
        super().init_swap_space(num_cpu_blocks)
        self.workers.broadcast(("init", self.num_blocks, num_cpu_blocks))

    def execute_model(self, so, sample: bool = True):
        """The step's SchedulerOutput goes to every worker (each keeps its own copy of the
        sequences and packs its own inputs), with the tokens rank 0 sampled last step (rank 0
        alone samples), then rank 0 runs it."""
        if so.scheduled or so.new_seqs or so.finished_seq_ids or self._sampled:
            self.workers.broadcast(("step", self._sampled, so))
        out = super().execute_model(so, sample)
        self._sampled = {sid: [s.token_id for s in run] for sid, run in out.sampled.items()}
        return out

    def apply_kv_ops(self, ops) -> None:
        self.workers.broadcast(("kv_ops", ops))
        super().apply_kv_ops(ops)


def _ray():
    """Ray, joined: $RAY_ADDRESS's cluster (a replica's: fleet/launcher.py) or a local instance,
    in the namespace the launcher named its placement group in."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install ray") from e
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                 namespace=os.environ.get(NAMESPACE_ENV))
    return ray


def _ray_node_ip() -> str:
    return _ray().util.get_node_ip_address()


def _rank_options(ray, size: int) -> list[dict]:
    """Each worker's actor options: bundle r of the replica's placement group when the launcher
    made one (config/placement.py), taking that bundle's CPUs; else anywhere, no CPU reserved."""
    name = os.environ.get(GROUP_ENV)
    if not name:
        return [{"num_cpus": 0} for _ in range(1, size)]
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = ray.util.get_placement_group(name)
    if group.bundle_count < size:
        raise ValueError(f"Ray placement group {name!r} has {group.bundle_count} bundles for {size} ranks")
    cpus = float(os.environ.get(RANK_CPUS_ENV, "0"))
    return [{"num_cpus": cpus, "scheduling_strategy": PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=rank)} for rank in range(1, size)]


def _start_ray_workers(config, size: int, init_method: str) -> list:
    ray = _ray()

    class Worker:
        def run(self, config, rank, size, init_method):
            run_worker(config, rank, size, init_method)

        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    actors = [ray.remote(max_restarts=0)(Worker).options(**o).remote() for o in _rank_options(ray, size)]
    logger.info("Ray workers on nodes %s", ray.get([a.node.remote() for a in actors], timeout=300))
    for rank, a in enumerate(actors, start=1):
        a.run.remote(config, rank, size, init_method)
    return actors


def _ray_kill(actor) -> None:
    import ray

    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001
        pass
