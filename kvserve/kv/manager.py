"""KV cache manager: per-request block tables over the shared pool (seed 003, paging, "Sharing
blocks, and copying on write", "Reusing the cache across requests", "When memory runs out").

It owns every piece of KV state, keyed by request id: block tables, prefix-cache progress
(`SeqCacheState`), swapped-out CPU block ids. It reads a request (token ids, salt, progress)
and never writes it: the scheduler asks it questions (`num_held_blocks`, `lookup`) and applies
what it answers (`allocate_prefill` returns the hit it used).

`allocate_slots` grows a request's block table so that its next tokens have slots; `free`
returns the request's blocks, tail first. The slot of token position `p` of a request is
`block_table[p // block_size] * block_size + p % block_size`.

Sharing: `fork` gives a new sequence (a sample of n > 1, a beam) the parent's block table with
one more reference on every block. A sequence about to write into a block that another table
also holds gets a private copy first (copy on write: `allocate_slots(..., num_computed=...)`),
so at most one block is copied per sequence per step. The manager never touches tensors:
copies and swaps are queued as block-id pairs (`PendingKVOps`) and the engine hands them to
the model runner (`take_pending`) before the forward pass. A copy's source keeps an extra
reference until then, so no other request can reuse it first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.offload import CpuSwapSpace
from kvserve.kv.prefix_cache import NO_HIT, HashPrefixCache, PrefixCache, PrefixHit, SeqCacheState
from kvserve.kv.radix_cache import RadixPrefixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_prefix_cache(kind: str | None, pool: BlockPool, block_size: int,
                      namespace: str = "") -> PrefixCache | None:
    if kind in (None, "none", False):
        return None
    caches = {"hash": HashPrefixCache, "radix": RadixPrefixCache}
    if kind not in caches:
        raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {kind!r}.")
    return caches[kind](pool, block_size, namespace)


@dataclass
class PendingKVOps:
    """Block moves to run before the next forward pass, in this order: swap out, swap in,
    copies. Every read must see the block as it was before the batch (`check`)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)   # (gpu block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu block, gpu block)
    copies: list[tuple[int, int]] = field(default_factory=list)     # (src gpu block, dst gpu block)
    # KV tiers (kv/connector.py): saves run first (they read blocks the batch may reuse), loads last
    saves: list[tuple[int, bytes, bool]] = field(default_factory=list)   # (gpu block, hash, evicted)
    loads: list[tuple[int, bytes]] = field(default_factory=list)         # (gpu block, verified data)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies or self.saves or self.loads)

    def check(self) -> None:
        """No block is written twice, and none is read after the batch wrote it (a swap-in
        reading a CPU block a swap-out of the same batch reused would read the wrong K/V)."""
        written: dict[str, set[int]] = {"gpu": set(), "cpu": set()}
        phases = [("swap out", self.swap_out, "gpu", "cpu"), ("swap in", self.swap_in, "cpu", "gpu"),
                  ("copy", self.copies, "gpu", "gpu")]
        for name, pairs, src_dev, dst_dev in phases:
            for src, _ in pairs:
                if src in written[src_dev]:
                    raise AssertionError(f"{name} reads {src_dev} block {src} after this batch wrote it")
            for _, dst in pairs:
                if dst in written[dst_dev]:
                    raise AssertionError(f"{name} writes {dst_dev} block {dst} twice in one batch")
                written[dst_dev].add(dst)
        for dst, _ in self.loads:
            if dst in written["gpu"]:
                raise AssertionError(f"load writes gpu block {dst} twice in one batch")
            written["gpu"].add(dst)


@dataclass
class KVStats:
    prefix_cache_queries: int = 0      # tokens looked up at admission
    prefix_cache_hits: int = 0         # of which found in the cache
    prefix_cache_eligible: int = 0     # of which the cache could have held at most
    cow_copies: int = 0                # blocks copied because a shared block was written
    partial_copies: int = 0            # radix hits on a partial block, copied into a fresh one
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: str | None = None,
                 cache_namespace: str = "", num_cpu_blocks: int = 0, kv_connector=None):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVBlock]] = {}
        self.cache = make_prefix_cache(prefix_cache, self.pool, block_size, cache_namespace)
        self.cache_state: dict[str, SeqCacheState] = {}  # request id -> prefix-cache progress
        self.swap_space = CpuSwapSpace(num_cpu_blocks)
        self.swapped_tables: dict[str, list[int]] = {}   # request id -> CPU block ids
        self._pending = PendingKVOps()
        self._copy_sources: list[KVBlock] = []           # held until the copies have run
        self.stats = KVStats()
        self.connector = kv_connector                    # KV tiers below the pool (kv/connector.py)
        if kv_connector is not None:
            kv_connector.bind(self)

    # -- questions ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_cached_blocks if self.cache is not None else 0

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.block_tables.get(request_id, ()))

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def fits_alone(self, num_tokens: int) -> bool:
        """Could one sequence of `num_tokens` tokens ever have all its slots (empty pool)?"""
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]

    def block_table(self, request_id: str) -> list[KVBlock] | None:
        """The request's table, to read only. It stays the same list object while it only grows
        (a copy on write or a rollback makes a new one; so do admission, fork and swap-in), so a
        reader can send what changed since it last looked: the blocks appended, or the whole
        table when the object is not the one it saw (engine/worker_view.py)."""
        return self.block_tables.get(request_id)

    def block_hashes(self, req, n_blocks: int) -> list[bytes]:
        """The chained hashes of req's first `n_blocks` blocks (the hash prefix cache's)."""
        return self.cache.hashes(req, self._state(req), n_blocks)

    def _state(self, req) -> SeqCacheState:
        st = self.cache_state.get(req.request_id)
        if st is None:
            st = self.cache_state[req.request_id] = SeqCacheState()
        return st

    # -- growth and copy on write ------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_tokens: int, reserve: int = 0,
                       num_computed: int | None = None) -> bool:
        """Make room for `num_tokens` tokens in all; False (and no change) if the pool is short.
        `reserve` free blocks must remain afterwards (the admission watermark). With
        `num_computed`, the block the next token is written into is made private first (CoW)."""
        table = self.block_tables.get(request_id)
        need = max(0, cdiv(num_tokens, self.block_size) - (len(table) if table else 0))
        cow = -1
        if table and num_computed is not None:
            j = num_computed // self.block_size
            if j < len(table) and table[j].ref_cnt > 1:
                cow = j
        if need + (cow >= 0) + reserve > self.pool.num_free_blocks:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        if cow >= 0:
            (new,) = self.pool.allocate(1)
            table = self.block_tables[request_id] = list(table)     # changed other than by growth: a new list
            src = table[cow]
            self._copy_sources.append(src)       # our reference now protects the source
            self._pending.copies.append((src.block_id, new.block_id))
            table[cow] = new
            self.stats.cow_copies += 1
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def rollback(self, request_id: str, num_computed: int) -> int:
        """Speculative decoding: the request's verified K/V ends at `num_computed` tokens.
        Blocks past `cdiv(num_computed, block_size)` hold only rejected drafts' K/V: they go
        back to the pool, tail first. A rejected slot in the last kept block is simply
        overwritten later (nothing reads past `num_computed`). Never labelled: the prefix
        cache labels only blocks full of computed (verified) tokens. Returns blocks freed."""
        table = self.block_tables.get(request_id)
        keep = cdiv(num_computed, self.block_size)
        if not table or len(table) <= keep:
            return 0
        dropped = table[keep:]
        self.block_tables[request_id] = table[:keep]      # changed other than by growth: a new list
        assert all(b.block_hash is None for b in dropped), "a block of unverified tokens was labelled"
        self.pool.free(reversed(dropped))
        return len(dropped)

    # -- prefix cache ------------------------------------------------------------------------
    def lookup(self, req) -> PrefixHit:
        """The cached prefix a request without blocks could start from (changes no block).
        No hit for a request that must compute its whole prompt (prompt logprobs)."""
        if (self.cache is None or req.num_computed_tokens or self.block_tables.get(req.request_id)
                or req.must_compute_prompt):
            return NO_HIT
        hit = self.cache.match(req, self._state(req))
        if self.connector is not None:                   # then the lower tiers, by copy
            hit = self.connector.extend_hit(req, self._state(req), hit, self.cache)
        return hit

    def allocate_prefill(self, req, hit: PrefixHit, num_tokens: int, reserve: int = 0) -> PrefixHit | None:
        """Admit a request without blocks: share the hit's blocks, copy its partial block,
        allocate the rest up to `num_tokens` tokens. Returns the hit used (the caller starts
        the request there): the partial copy is dropped when its source would be the one block
        too many. None, changing nothing, if the pool is short."""
        if hit.copy_src is not None and not self._fits(hit, num_tokens, reserve):
            hit = PrefixHit(hit.blocks, None, 0, len(hit.blocks) * self.block_size)
        if not self._fits(hit, num_tokens, reserve):
            return None
        for b in hit.blocks:
            self.pool.touch(b)
        table = list(hit.blocks)
        if hit.copy_src is not None:
            self.pool.touch(hit.copy_src)
            self._copy_sources.append(hit.copy_src)
        new = self.pool.allocate(cdiv(num_tokens, self.block_size) - len(hit.blocks))
        if self.connector is not None:                   # tier blocks: verified, queued as loads
            hit = self.connector.stage_loads(hit, new)
        if hit.copy_src is not None:
            self._pending.copies.append((hit.copy_src.block_id, new[0].block_id))
            self.stats.partial_copies += 1
        table += new
        self.block_tables[req.request_id] = table
        if self.cache is not None:
            st = self._state(req)
            st.reset()
            s = self.stats
            s.prefix_cache_queries += req.num_tokens
            s.prefix_cache_hits += hit.num_tokens
            s.prefix_cache_eligible += 0 if req.must_compute_prompt else self.cache.eligible_tokens(req)
        return hit

    def _fits(self, hit: PrefixHit, num_tokens: int, reserve: int) -> bool:
        fresh = cdiv(num_tokens, self.block_size) - len(hit.blocks)
        taken = sum(1 for b in hit.blocks if b.ref_cnt == 0)       # leave the free queue
        if hit.copy_src is not None and hit.copy_src.ref_cnt == 0:
            taken += 1                                              # held until copied
        return fresh + taken + reserve <= self.pool.num_free_blocks

    def cache_blocks(self, req) -> None:
        """After a forward pass: label the request's newly computed full blocks."""
        if self.cache is not None:
            table = self.block_tables.get(req.request_id)
            if table:
                st = self._state(req)
                before = st.num_labelled_blocks
                self.cache.cache_full_blocks(req, st, table)
                if self.connector is not None and st.num_labelled_blocks > before:
                    self.connector.on_labelled(table[before:st.num_labelled_blocks])

    # -- sharing -----------------------------------------------------------------------------
    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (one more reference each)."""
        blocks = self.block_tables.get(parent_id, [])
        for b in blocks:
            self.pool.touch(b)
        self.block_tables[child_id] = list(blocks)
        st = self.cache_state.get(parent_id)
        if st is not None:
            self.cache_state[child_id] = st.fork()

    def free(self, request_id: str, req=None) -> None:
        """Return every block of the request, tail first, so that shared heads live longest,
        and forget its KV state. With `req`, a radix cache first keeps its partial last block."""
        blocks = self.block_tables.pop(request_id, None)
        st = self.cache_state.pop(request_id, None)
        if blocks:
            if self.cache is not None and req is not None:
                self.cache.cache_partial_block(req, st or SeqCacheState(), blocks)
            self.pool.free(reversed(blocks))
        cpu = self.swapped_tables.pop(request_id, None)
        if cpu:
            for i in cpu:
                self.swap_space.decref(i)

    # -- swapping ----------------------------------------------------------------------------
    def swap_out(self, reqs: list) -> bool:
        """Copy the requests' blocks to CPU (shared blocks once) and free them on the GPU.
        False, changing nothing, if the swap space is short."""
        distinct: dict[int, KVBlock] = {}
        for r in reqs:
            for b in self.block_tables.get(r.request_id, ()):
                distinct.setdefault(b.block_id, b)
        if len(distinct) > self.swap_space.num_free_blocks:
            return False
        cpu_ids = self.swap_space.allocate(len(distinct))
        to_cpu = dict(zip(distinct, cpu_ids))
        self._pending.swap_out.extend(to_cpu.items())
        self.stats.swap_out_blocks += len(distinct)
        seen: set[int] = set()
        for r in reqs:
            table = self.block_tables.get(r.request_id, [])
            ids = [to_cpu[b.block_id] for b in table]
            for i in ids:
                if i in seen:
                    self.swap_space.incref(i)
                seen.add(i)
            self.free(r.request_id, r)
            self.swapped_tables[r.request_id] = ids
        return True

    def swap_in(self, reqs: list, reserve: int = 0) -> bool:
        """Bring swapped requests back into fresh GPU blocks. False, changing nothing, if short."""
        distinct: list[int] = []
        seen: set[int] = set()
        for r in reqs:
            for i in self.swapped_tables.get(r.request_id, ()):
                if i not in seen:
                    seen.add(i)
                    distinct.append(i)
        if len(distinct) + reserve > self.pool.num_free_blocks:
            return False
        gpu = dict(zip(distinct, self.pool.allocate(len(distinct))))
        self._pending.swap_in.extend((i, b.block_id) for i, b in gpu.items())
        self.stats.swap_in_blocks += len(distinct)
        used: set[int] = set()
        for r in reqs:
            ids = self.swapped_tables.pop(r.request_id, [])
            table = []
            for i in ids:
                b = gpu[i]
                if i in used:
                    self.pool.touch(b)
                used.add(i)
                table.append(b)
                self.swap_space.decref(i)
            self.block_tables[r.request_id] = table
        return True

    def take_pending(self) -> PendingKVOps:
        """The block moves queued since the last call, checked; the caller runs them before the
        next forward pass (and before the next schedule). Releases the copy sources."""
        ops, self._pending = self._pending, PendingKVOps()
        if self.connector is not None:
            ops.saves, ops.loads = self.connector.take()
        ops.check()
        if self._copy_sources:
            self.pool.free(self._copy_sources)
            self._copy_sources = []
        return ops

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self.block_tables.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self._copy_sources:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == counts.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {counts.get(b.block_id, 0)} tables")
        cpu: dict[int, int] = {}
        for ids in self.swapped_tables.values():
            for i in ids:
                cpu[i] = cpu.get(i, 0) + 1
        self.swap_space.check_integrity(cpu)
        if self.cache is not None:
            self.cache.check_integrity()
