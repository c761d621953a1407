"""KV memory policies of seed 003 ("Why the cache needs pages", "Sharing blocks, and copying on
write", "When memory runs out", the allocator widget): reserve-max contiguous allocation, paging,
paging with shared prompt blocks, n samples per request, and preemption by recompute.

`BlockAllocator` is the seed's placeholder made real (refcounted blocks, copy-on-write of a shared
partial block); `simulate_paging` replays the widget's toy memory step by step; `batch_capacity`
packs mid-decode sequences under each policy, as the seed's paging cell does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class BlockAllocator:
    """Seed 003 `BlockAllocator`: a pool of n_blocks blocks of block_size token slots, refcounted.

    allocate(seq, n_tokens) grows `seq` to n_tokens slots, taking blocks as needed (raises MemoryError
    if the pool cannot supply them, leaving `seq` unchanged); fork(parent, child) shares every block of
    the parent (refcount + 1); the first write into a shared, partly filled last block copies it
    (copy-on-write, recorded in `copies` as (src, dst)); free(seq) drops the references.
    """

    def __init__(self, n_blocks: int, block_size: int):
        self.n_blocks, self.block_size = n_blocks, block_size
        self.free_blocks = list(range(n_blocks - 1, -1, -1))
        self.refcount = [0] * n_blocks
        self.tables: dict = {}   # seq -> list of block ids
        self.lengths: dict = {}  # seq -> tokens written
        self.copies: list[tuple[int, int]] = []

    @property
    def n_free(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq, n_tokens: int) -> int:
        """Blocks `allocate(seq, n_tokens)` would take from the pool (including a copy-on-write)."""
        table, length = self.tables.get(seq, []), self.lengths.get(seq, 0)
        need = max(0, math.ceil(n_tokens / self.block_size) - len(table))
        if n_tokens > length and length % self.block_size and table and self.refcount[table[-1]] > 1:
            need += 1
        return need

    def _take(self) -> int:
        b = self.free_blocks.pop()
        self.refcount[b] = 1
        return b

    def allocate(self, seq, n_tokens: int) -> list[int]:
        if self.blocks_needed(seq, n_tokens) > self.n_free:
            raise MemoryError(f"out of KV blocks: {seq!r} needs {self.blocks_needed(seq, n_tokens)}, "
                              f"{self.n_free} free")
        table = self.tables.setdefault(seq, [])
        length = self.lengths.get(seq, 0)
        if n_tokens > length and length % self.block_size and table and self.refcount[table[-1]] > 1:
            old = table[-1]
            self.refcount[old] -= 1
            table[-1] = self._take()
            self.copies.append((old, table[-1]))
        while len(table) * self.block_size < n_tokens:
            table.append(self._take())
        self.lengths[seq] = max(length, n_tokens)
        return table

    def fork(self, parent, child) -> None:
        """The child shares all the parent's blocks (parallel sampling, beam search)."""
        self.tables[child] = list(self.tables[parent])
        self.lengths[child] = self.lengths[parent]
        for b in self.tables[child]:
            self.refcount[b] += 1

    def free(self, seq) -> None:
        for b in reversed(self.tables.pop(seq, [])):  # tail first (seed 003)
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self.free_blocks.append(b)
        self.lengths.pop(seq, None)

    def used_slots(self) -> int:
        return (self.n_blocks - self.n_free) * self.block_size


def average_paging_waste(block_size: int, lengths) -> float:
    """Measured mean wasted slots in the last block, ceil(T / n_blk) n_blk - T, over `lengths`; seed 003
    predicts (n_blk - 1) / 2 for lengths uniform modulo n_blk."""
    T = np.asarray(lengths)
    return float(np.mean(np.ceil(T / block_size) * block_size - T))


# -- the allocator widget --------------------------------------------------------------------------
@dataclass
class _Req:
    rid: int
    arrival: int
    prompt: int
    answers: list
    generated: list = field(default_factory=list)
    admitted_order: int = -1


def widget_trace(seed: int = 0, n_steps: int = 400, sys_prompt: int = 64, question=(8, 71), answer=(16, 160),
                 gap=(3, 10)) -> list[tuple[int, int, int]]:
    """Seed 003's allocator widget traffic: a request every 3 to 10 steps; prompt = 64-token system
    prompt + a question of 8 to 71 tokens; answer 16 to 160 tokens (uniform integers, an assumption:
    the seed gives only the ranges). Returns (arrival step, prompt tokens, answer seed) triples."""
    rng = np.random.default_rng(seed)
    out, t = [], 0
    while t < n_steps:
        out.append((t, sys_prompt + int(rng.integers(question[0], question[1] + 1)), int(rng.integers(1 << 30))))
        t += int(rng.integers(gap[0], gap[1] + 1))
    return out


def simulate_paging(trace, policy: str, n_samples: int = 1, memory_slots: int = 1024, block_size: int = 16,
                    max_answer: int = 160, answer=(16, 160), n_steps: int = 160, watermark: bool = True) -> dict:
    """Replay seed 003's allocator widget for n_steps steps and report running sequences, finished
    and rejected requests, preemptions and the share of memory holding real tokens.

    policy 'reserve': each sample gets one contiguous buffer of prompt + max_answer slots (first fit
        over the free gaps, so external fragmentation is real); a request whose samples cannot fit
        even in empty memory is turned away; otherwise it waits at the head of the queue.
    policy 'paged': blocks of block_size allocated on demand; each sample stores its own prompt.
    policy 'shared': as 'paged', but the samples of a request share one copy of the prompt: the first
        live sample holds it and the others fork it (vLLM's parent sequence); the first write into the
        shared partial last block copies it for every writer but the last (copy-on-write), so one
        sample costs exactly what 'paged' costs.
    Paged policies admit a request when its prompt(s) fit with one spare block per running sequence
    (`watermark`, an assumption against thrash; vLLM keeps a similar reserve), and when a running sequence needs a block
    and none is free, preempt the newest request (all its samples), free its blocks, and put it back
    at the head of the queue to recompute its prompt and generated tokens later (seed 003).
    Every running sample writes one token per step; a sample that has written its answer frees its own
    memory at once (blocks, or its reserved buffer), as vLLM frees a finished sequence of a group; a
    request finishes when all its samples have.
    """
    if policy not in ("reserve", "paged", "shared"):
        raise ValueError("policy must be 'reserve', 'paged' or 'shared'")
    reqs = []
    for i, (arr, prompt, s) in enumerate(trace):
        rng = np.random.default_rng(s)
        reqs.append(_Req(i, arr, prompt, [int(x) for x in rng.integers(answer[0], answer[1] + 1, n_samples)]))
    waiting: list[_Req] = []
    running: list[_Req] = []
    finished, rejected, preemptions, order = [], [], 0, 0
    alloc = BlockAllocator(memory_slots // block_size, block_size)
    gaps: list[list[int]] = [[0, memory_slots]]  # reserve: free [start, end) intervals, sorted
    buffers: dict = {}
    nxt = 0
    history = []

    def reserve_fit(size):
        for g in gaps:
            if g[1] - g[0] >= size:
                return g
        return None

    def merge_gaps():
        gaps.sort()
        merged = [gaps[0]]
        for g in gaps[1:]:
            if g[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], g[1])
            else:
                merged.append(g)
        gaps[:] = merged

    def release_reserve(r, samples=None):
        for k in (range(len(r.answers)) if samples is None else samples):
            if (r.rid, k) in buffers:
                s, e = buffers.pop((r.rid, k))
                gaps.append([s, e])
        merge_gaps()

    def release_paged(r, samples=None):
        for k in (range(len(r.answers)) if samples is None else samples):
            alloc.free((r.rid, k))

    def shared_need(prompt, gen_live) -> int:
        """Blocks that admitting live samples at generated counts gen_live takes under 'shared': the
        prompt once, each sample's blocks past the prompt, and one copy of a shared partial last block
        per sample that has written into it, except the last holder (it writes in place)."""
        full = math.ceil(prompt / block_size)
        own = sum(math.ceil((prompt + g) / block_size) - full for g in gen_live)
        writers = sum(1 for g in gen_live if g > 0)
        copies = min(writers, len(gen_live) - 1) if prompt % block_size else 0
        return full + own + copies

    def try_admit(r) -> bool:
        nonlocal order
        if policy == "reserve":
            size = r.prompt + max_answer
            if len(r.answers) * size > memory_slots:
                return False
            placed = []
            for k in range(len(r.answers)):
                g = reserve_fit(size)
                if g is None:
                    break
                buffers[(r.rid, k)] = (g[0], g[0] + size)
                placed.append((r.rid, k))
                g[0] += size
                gaps[:] = [x for x in gaps if x[1] > x[0]] or [[memory_slots, memory_slots]]
            if len(placed) < len(r.answers):  # undo a partial placement
                for key in placed:
                    gaps.append(list(buffers.pop(key)))
                merge_gaps()
                return False
        else:
            gen = r.generated or [0] * len(r.answers)
            # watermark (an assumption): keep one free block per running sequence after admission, so
            # that the sequences already running can write their next token without a preemption
            reserve = sum(len(x.answers) for x in running) if watermark else 0
            live = [k for k, g in enumerate(gen) if g < r.answers[k]]  # finished samples hold nothing
            if policy == "shared":
                need = shared_need(r.prompt, [gen[k] for k in live])
                if need + reserve > alloc.n_free:
                    return False
                owner = live[0]
                alloc.allocate((r.rid, owner), r.prompt)
                for k in live[1:]:
                    alloc.fork((r.rid, owner), (r.rid, k))
                for k in live:
                    if gen[k]:
                        alloc.allocate((r.rid, k), r.prompt + gen[k])
            else:
                need = sum(math.ceil((r.prompt + gen[k]) / block_size) for k in live)
                if need + reserve > alloc.n_free:
                    return False
                for k in live:
                    alloc.allocate((r.rid, k), r.prompt + gen[k])
        if not r.generated:
            r.generated = [0] * len(r.answers)
        r.admitted_order = order
        order += 1
        running.append(r)
        return True

    for step in range(n_steps):
        while nxt < len(reqs) and reqs[nxt].arrival <= step:
            waiting.append(reqs[nxt]); nxt += 1
        while waiting:
            r = waiting[0]
            if policy == "reserve" and len(r.answers) * (r.prompt + max_answer) > memory_slots:
                rejected.append(waiting.pop(0))
                continue
            if try_admit(r):
                waiting.pop(0)
            else:
                break
        # every running sample writes one token
        for r in sorted(running, key=lambda x: x.admitted_order):
            if r not in running:
                continue
            for k in range(len(r.answers)):
                if r.generated[k] >= r.answers[k]:
                    continue
                if policy != "reserve":
                    key = (r.rid, k)
                    newlen = r.prompt + r.generated[k] + 1
                    while alloc.blocks_needed(key, newlen) > alloc.n_free:
                        victim = max(running, key=lambda x: x.admitted_order)
                        running.remove(victim)
                        release_paged(victim)
                        preemptions += 1
                        waiting.insert(0, victim)
                        waiting.sort(key=lambda x: x.arrival)
                        if victim is r:
                            break
                    if r not in running:
                        break
                    alloc.allocate(key, newlen)
                r.generated[k] += 1
                if r.generated[k] >= r.answers[k]:  # this sample is done: its memory goes back now
                    (release_reserve if policy == "reserve" else release_paged)(r, [k])
        for r in list(running):
            if all(g >= a for g, a in zip(r.generated, r.answers)):
                running.remove(r)
                (release_reserve if policy == "reserve" else release_paged)(r)
                finished.append(r)
        held = 0
        for r in running:
            live = [g for g, a in zip(r.generated, r.answers) if g < a]
            held += r.prompt * (min(1, len(live)) if policy == "shared" else len(live)) + sum(live)
        history.append({"step": step + 1, "running_requests": len(running),
                        "running_sequences": sum(sum(g < a for g, a in zip(r.generated, r.answers)) or 0
                                                 for r in running),
                        "finished": len(finished), "token_share": held / memory_slots})
    return {"policy": policy, "n_samples": n_samples, "step": n_steps,
            "running_sequences": history[-1]["running_sequences"] if history else 0,
            "running_requests": len(running), "finished": len(finished), "rejected": len(rejected),
            "preemptions": preemptions, "token_share": history[-1]["token_share"] if history else 0.0,
            "history": history}


# -- batch capacity under each policy --------------------------------------------------------------
def batch_capacity(kv_budget_bytes: float, m_kv: float, prompts, outputs_so_far, max_new_tokens: int,
                   max_model_len: int, block_size: int = 16) -> dict:
    """Seed 003's paging cell: pack mid-decode sequences (prompt, tokens generated so far) in order
    until the KV budget runs out, under four policies, and count how many fit:
      'reserve-context'   contiguous buffer of max_model_len tokens per sequence,
      'reserve-max'       contiguous buffer of prompt + max_new_tokens,
      'paged'             ceil(current tokens / n_blk) blocks,
      'exact'             current tokens (the ideal, no waste).
    Returns {policy: (sequences that fit, share of the reserved bytes that hold real tokens)}."""
    prompts = np.asarray(prompts)
    cur = prompts + np.asarray(outputs_so_far)
    sizes = {
        "reserve-context": np.full(len(cur), max_model_len),
        "reserve-max": prompts + max_new_tokens,
        "paged": np.ceil(cur / block_size) * block_size,
        "exact": cur,
    }
    out = {}
    for name, s in sizes.items():
        used = np.cumsum(s) * m_kv
        k = int(np.searchsorted(used, kv_budget_bytes, side="right"))
        out[name] = (k, float(cur[:k].sum() / s[:k].sum()) if k else 0.0)
    return out
