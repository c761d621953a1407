"""Batching the embedding requests of every client: one worker thread runs the model, never the
event loop.

    submit(prompts) -> EmbeddingJob (its `future`: [n, dim] float32)
    worker: take what is queued -> a batch: the oldest prompt not yet run and, in order of
            length, the queued prompts nearest it, at most `max_batch_tokens` padded tokens
            (batch size x its longest prompt; a longer prompt runs alone) and `max_batch_seqs`
            prompts -> model.embed(batch) -> rows back to their jobs

Grouping by length is what sentence-transformers' encode does (it sorts its inputs): an encoder
pads every prompt of a batch to the longest, and arrival order mixed 8- and 64-word texts to
0.56x of its speed (benchmarks/bench_embeddings.py); starting each batch at the oldest prompt
keeps a prompt from waiting behind ever newer ones.

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
LOOKAHEAD = 4096                # queued prompts a batch is chosen from


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
        self.pending = dict.fromkeys(range(len(prompts)))     # prompts not yet batched, in order
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
            while active and (active[0].cancelled or not active[0].pending):
                self._drop(active.popleft())        # (a finished job is gone already)

    def _take(self, active: deque) -> list[tuple[EmbeddingJob, int]]:
        """The next batch (module docstring), from the first LOOKAHEAD queued prompts."""
        pending = []                    # (length, job, index), in arrival order
        for job in list(active):
            if job.cancelled:
                self._drop(job)
                continue
            pending += [(len(job.prompts[i]), job, i) for i in job.pending]
            if len(pending) >= LOOKAHEAD:
                break
        if not pending:
            return []
        by_length = sorted(range(len(pending)), key=lambda k: pending[k][0])     # stable
        lo = hi = by_length.index(0)    # the oldest prompt; the batch is by_length[lo:hi + 1]
        longest = pending[0][0]
        while hi - lo + 1 < self.max_batch_seqs:
            if lo > 0 and (hi - lo + 2) * longest <= self.max_batch_tokens:
                lo -= 1                 # a shorter one pads to the batch's longest
            elif hi + 1 < len(by_length) and \
                    (hi - lo + 2) * max(longest, pending[by_length[hi + 1]][0]) <= self.max_batch_tokens:
                hi += 1
                longest = max(longest, pending[by_length[hi]][0])
            else:
                break
        batch = [pending[k][1:] for k in by_length[lo:hi + 1]]
        for job, i in batch:
            del job.pending[i]
        return batch

    def _drop(self, job: EmbeddingJob) -> None:
        with self._lock:
            if job in self._jobs:
                self._jobs.discard(job)
                self._count("num_waiting", -len(job.pending))
                job.pending.clear()

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
