"""Batching the embedding requests of every client: one worker thread runs the model, never the
event loop.

    submit(prompts) -> EmbeddingJob (its `future`: [n, dim] float32)
    worker: take what is queued -> batches in arrival order, each at most `max_batch_tokens`
            padded tokens (batch size x its longest prompt; a longer prompt runs alone) and
            `max_batch_seqs` prompts -> model.embed(batch) -> rows back to their jobs

A request's prompts may span several batches and a batch may hold several requests' prompts.
The queue is bounded (`max_waiting` requests unfinished: `QueueFull` beyond it, the server's
503); a cancelled job (its client left, the shutdown deadline) is skipped; a forward pass that
raises fails only the jobs with prompts in that batch. `stats` (an EngineStats) counts what
/metrics shows: prompts waiting and running, prompt tokens, forward passes and their time.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

import numpy as np

logger = logging.getLogger("kvserve.pooling")


class QueueFull(Exception):
    """`max_waiting` requests are already queued or running."""


class BatcherClosed(Exception):
    """The batcher has stopped (the server is shutting down)."""


class EmbeddingJob:
    """The prompts of one request and the future of their embeddings [n, dim]."""

    def __init__(self, prompts: list[list[int]]):
        self.prompts = prompts
        self.future: Future = Future()
        self.rows: list = [None] * len(prompts)
        self.next = 0                   # the first prompt not yet given to a batch
        self.remaining = len(prompts)
        self.cancelled = False

    def cancel(self) -> None:
        """Run none of the prompts not yet batched (the client left)."""
        self.cancelled = True
        self.future.cancel()


def _settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass                            # cancelled or failed meanwhile


class EmbeddingBatcher:
    def __init__(self, model, max_batch_tokens: int, max_batch_seqs: int,
                 max_waiting: int | None = None, stats=None):
        self.model = model
        self.max_batch_tokens, self.max_batch_seqs = max_batch_tokens, max_batch_seqs
        self.max_waiting = max_waiting
        self.stats = stats
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._jobs: set[EmbeddingJob] = set()        # unfinished: queued or in the worker
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvserve-embed-batcher", daemon=True)

    def start(self) -> None:
        if not self._thread.is_alive() and not self._closed:
            self._thread.start()

    def submit(self, prompts: list[list[int]]) -> EmbeddingJob:
        job = EmbeddingJob(prompts)
        with self._lock:
            if self._closed:
                raise BatcherClosed("the embedding worker has stopped")
            if self.max_waiting is not None and len(self._jobs) >= self.max_waiting:
                raise QueueFull(f"{len(self._jobs)} embedding requests are already waiting")
            self._jobs.add(job)
            self._count("num_waiting", len(prompts))
        self._queue.put(job)
        return job

    def fail_all(self, error: BaseException) -> None:
        """Fail every unfinished job with `error` (their prompts not yet run are skipped)."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancelled = True
            _settle(job.future, error=error)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs, fail the unfinished ones, stop the worker (idempotent)."""
        with self._lock:
            self._closed = True
        self.fail_all(BatcherClosed("the server is shutting down"))
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- the worker thread ------------------------------------------------------------------
    def _run(self) -> None:
        active: deque[EmbeddingJob] = deque()
        while True:
            if not active:
                job = self._queue.get()
                if job is None:
                    return
                active.append(job)
            while True:                             # everything queued meanwhile
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                active.append(job)
            batch = self._take(active)
            if batch:
                self._forward(batch)
            while active and (active[0].cancelled or active[0].next == len(active[0].prompts)):
                self._drop(active.popleft())        # (a finished job is gone already)

    def _take(self, active: deque) -> list[tuple[EmbeddingJob, int]]:
        """The next batch: prompts in arrival order while the padded batch fits the budget."""
        batch, longest = [], 0
        for job in active:
            if job.cancelled:
                self._drop(job)
                continue
            while job.next < len(job.prompts):
                n = len(job.prompts[job.next])
                fits = (len(batch) + 1) * max(longest, n) <= self.max_batch_tokens
                if batch and (not fits or len(batch) >= self.max_batch_seqs):
                    return batch
                batch.append((job, job.next))
                longest = max(longest, n)
                job.next += 1
        return batch

    def _drop(self, job: EmbeddingJob) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.discard(job)
                self._count("num_waiting", -(len(job.prompts) - job.next))
                job.next = len(job.prompts)

    def _forward(self, batch: list[tuple[EmbeddingJob, int]]) -> None:
        prompts = [job.prompts[i] for job, i in batch]
        with self._lock:
            self._count("num_waiting", -len(prompts))
        self._set("num_running", len(prompts))
        t0 = time.perf_counter()
        try:
            vecs = self.model.embed(prompts).numpy()         # [len(batch), dim] float32
        except Exception as e:  # noqa: BLE001 -- this batch's requests fail, the others go on
            logger.exception("an embedding forward pass failed")
            for job in {job for job, _ in batch}:
                job.cancelled = True
                _settle(job.future, error=e)
                self._drop(job)
            return
        finally:
            self._set("num_running", 0)
        dt = time.perf_counter() - t0
        self._count("num_steps", 1)
        self._count("prompt_tokens_total", sum(map(len, prompts)))
        self._count("forward_time_total", dt)
        self._count("step_time_total", dt)
        for (job, i), vec in zip(batch, vecs):
            job.rows[i] = vec
            job.remaining -= 1
            if job.remaining == 0:
                with self._lock:
                    self._jobs.discard(job)
                _settle(job.future, np.stack(job.rows))

    def _count(self, name: str, n) -> None:
        if self.stats is not None:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _set(self, name: str, value) -> None:
        if self.stats is not None:
            setattr(self.stats, name, value)
