"""The KV connector: prefix-cache blocks that leave the device pool and come back (seed 003,
"Tiers of KV storage"; the idea of vLLM's KV connectors and LMCache, in kvserve's terms).

A connector does three things, all keyed by the chained block hash of kv/prefix_cache.py
(which commits to the whole prefix, the model namespace and the `cache_salt`, so every tier
inherits tenant isolation):
  - save the K/V of full, hashed blocks: a block is saved when the pool reuses it (eviction,
    `BlockPool.on_evict`: it moves down into the first tier; a full CPU tier moves its oldest
    block further down) and, for write-through tiers (disk, Redis), as soon as it is labelled;
  - answer how many leading blocks of a request's hash chain the tiers hold (`extend_hit`, after
    the device-pool hit ends);
  - load them into fresh pool blocks: at admission the payloads are fetched and their checksums
    verified (`stage_loads`; the hit ends at the first missing or corrupt block, so a corrupt
    block is recomputed, never served), and the copies into the pool are queued like a swap-in
    (`PendingKVOps.loads`) and run by the model runner before the forward pass.
The scheduler sees a lower-tier hit as a prefix hit whose blocks arrive by copy, not compute.

Reload or recompute (seed 003): a prompt of T cached tokens reloads in T m_KV / b_tier and
recomputes in T / Theta_prefill, so reloading wins when b_tier > m_KV x Theta_prefill.
`ReloadRule` measures both: each tier's bandwidth (a probe at start, then every real fetch,
checksum included) and the engine's prefill throughput (tokens per second of the forward
passes that are mostly prefill). Each admission applies the rule to the tiers its blocks
come from; the decisions and the figures are in `engine.stats().kv_tiers`.

Store keys: the chained block hash, scoped by a fingerprint of the weights and the KV layout
(`block_io.store_scope`), so that a disk tier that outlives a checkpoint, or a Redis store
shared by engines with other quantizations, never serves K/V computed by other weights.
Payloads: kv/block_io.py.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.kv.block_io import (PAYLOAD_OVERHEAD, load_into, pack_block, store_key,
                                 unpack_block)
from kvserve.kv.prefix_cache import PrefixHit
from kvserve.kv.reload_rule import ReloadRule
from kvserve.kv.tiers import KVStore, parse_tier_spec, split_tier_specs


@dataclass
class TierHit(PrefixHit):
    """A prefix hit whose blocks after the device-pool ones (`blocks`) come from the tiers."""

    tier_hashes: list[bytes] = field(default_factory=list)   # store keys to load, in chain order
    tier_src: list[int] = field(default_factory=list)        # index of the tier holding each
    skipped: int = 0          # tier blocks the reload rule chose to recompute


@dataclass
class TierStats:
    hit_blocks: int = 0           # blocks loaded from this tier into the pool
    bytes_loaded: int = 0         # bytes fetched and verified (fetched blocks past a corrupt one count)
    saved_blocks: int = 0         # blocks written into this tier (evicted, demoted or written through)
    bytes_saved: int = 0
    demoted_blocks: int = 0       # blocks this tier moved down to the next one
    corrupt_blocks: int = 0       # payloads that failed the checksum (dropped, recomputed)
    failures: int = 0             # store errors (unreachable): each skips the store for RETRY_S;
                                  # stats_dict adds the store's own failed background writes
    bandwidth: float | None = None   # measured bytes/s of fetch + checksum (EMA)
    probe_bandwidth: float | None = None   # the start-up probe's figure


class KVConnector:
    """The interface. The KV manager asks `extend_hit` / `stage_loads` and reports labels. The
    model runner calls its `kv_connector` at named points: `save_blocks` first in
    `apply_kv_ops` (before any block move or write of the step), `load_blocks` last in it
    (before the forward pass), `after_forward` at the end of `execute`; blocks are read and
    written by the runner (`read_kv_blocks` / `write_kv_blocks`: worker/kv_blocks.py)."""

    def extend_hit(self, req, st, hit: PrefixHit, cache) -> PrefixHit:
        return hit

    def stage_loads(self, hit: PrefixHit, new_blocks: list) -> PrefixHit:
        return hit

    def on_labelled(self, blocks: list) -> None:
        pass

    def take(self) -> tuple[list, list]:
        return [], []

    def save_blocks(self, runner, saves: list[tuple[int, bytes, bool]]) -> None:
        pass

    def load_blocks(self, runner, loads: list[tuple[int, bytes]]) -> None:
        pass

    def after_forward(self, scheduled, seconds: float) -> None:
        """One `execute` of `scheduled` took `seconds` (inputs, forward pass and sync)."""


class TieredConnector(KVConnector):
    """The stack of stores of `kv_tiers`, top (fastest) first."""

    WRITTEN_MEMORY = 1 << 16     # hashes remembered as written through (skips re-reading them)
    RETRY_S = 5.0                # a failed store is skipped this long

    def __init__(self, stores: list[KVStore], block_size: int, policy: str = "auto", scope: bytes = b""):
        self.scope = scope                          # store key = sha256(scope + block hash)
        self.stores = stores
        self.block_size = block_size
        self.policy = policy
        self.stats = [TierStats() for _ in stores]
        self.rule: ReloadRule | None = None        # set by attach_runner (m_KV comes from the pools)
        self.block_bytes = 0
        self.reload_decisions = 0                   # admissions that loaded tier blocks
        self.recompute_decisions = 0                # admissions whose tier blocks the rule skipped
        self.tier_hit_tokens = 0
        self._saves: dict[int, tuple[bytes, bool]] = {}   # gpu block -> (hash, evicted)
        self._loads: list[tuple[int, bytes]] = []         # (gpu block, verified data)
        self._wt = [i for i, s in enumerate(stores) if s.write_through]
        self._evict_to = next((i for i, s in enumerate(stores) if s.saves), None)   # evicted blocks' tier
        self._written: OrderedDict[bytes, None] = OrderedDict()   # recently written through
        self._down_until = [0.0] * len(stores)      # monotonic time until which a store is skipped

    @classmethod
    def from_specs(cls, specs, block_size: int, reload: str, scope: bytes, top: KVStore | None = None
                   ) -> "TieredConnector | None":
        """The stack `specs` names (--kv-tiers, top first) under `top` (a KV stream's inbox), None
        for none; `scope`: store_scope's."""
        stores = ([top] if top is not None else []) + [parse_tier_spec(s) for s in split_tier_specs(specs)]
        return cls(stores, block_size, reload, scope) if stores else None

    def _key(self, block_hash: bytes) -> bytes:
        return store_key(self.scope, block_hash)

    # -- the KV manager's side ---------------------------------------------------------------
    def bind(self, manager) -> None:
        """Hear of every labelled block the pool reuses: it is saved before it is overwritten
        (saves run first in `apply_kv_ops`, before any write of the batch)."""
        pool, inner = manager.pool, manager.pool.on_evict

        def on_evict(block):
            if block.block_hash is not None:
                self._saves[block.block_id] = (block.block_hash, True)
            if inner is not None:
                inner(block)
        pool.on_evict = on_evict

    def on_labelled(self, blocks: list) -> None:
        """Blocks the prefix cache just labelled: write-through tiers get them next step."""
        if self._wt:
            for b in blocks:
                h = b.block_hash
                if h is not None and b.block_id not in self._saves and h not in self._written:
                    self._saves[b.block_id] = (h, False)

    def _locate(self, keys: list[bytes]) -> list[int | None]:
        """For each key, the first tier that holds it (None: no tier)."""
        found: list[int | None] = [None] * len(keys)
        for ti, store in enumerate(self.stores):
            todo = [i for i, f in enumerate(found) if f is None]
            if not todo:
                break
            if self._is_down(ti):
                continue
            try:
                have = store.contains_many([keys[i] for i in todo])
            except Exception:  # noqa: BLE001 -- an unreachable store (Redis down) holds nothing
                self._mark_down(ti)
                continue
            for i, ok in zip(todo, have):
                if ok:
                    found[i] = ti
        return found

    def extend_hit(self, req, st, hit: PrefixHit, cache) -> PrefixHit:
        """The device-pool hit plus the leading blocks of the rest of the chain the tiers hold
        (capped one token short of the prompt, as the pool's hit is), cut at the first block
        whose tier the reload rule says to recompute."""
        bs = self.block_size
        n = (req.num_tokens - 1) // bs
        g = len(hit.blocks)
        if g >= n or hit.copy_src is not None:
            return hit
        rest = [self._key(h) for h in cache.hashes(req, st, n)[g:n]]      # store keys
        src = []
        for ti in self._locate(rest):
            if ti is None:
                break
            src.append(ti)
        if not src:
            return hit
        wins = {ti: self.rule is None or self.stores[ti].always_reload
                or self.rule.reload_wins(self.stats[ti].bandwidth) for ti in set(src)}
        k = next((i for i, ti in enumerate(src) if not wins[ti]), len(src))
        return TierHit(list(hit.blocks), None, 0, (g + k) * bs, tier_hashes=rest[:k], tier_src=src[:k],
                       skipped=len(src) - k)

    def stage_loads(self, hit: PrefixHit, new_blocks: list) -> PrefixHit:
        """Admission of a TierHit: fetch and verify its payloads (from the tier that holds each,
        then any lower one), queue their copies into `new_blocks` (the request's first fresh
        blocks) and return the hit cut at the first block that is missing or corrupt."""
        if not isinstance(hit, TierHit):
            return hit
        if hit.skipped:
            self.recompute_decisions += 1
        keys, src = hit.tier_hashes, hit.tier_src
        datas: list = [None] * len(keys)
        for ti in sorted(set(src)):                    # one batched fetch per tier
            idx = [i for i, t in enumerate(src) if t == ti]
            for i, d in zip(idx, self._fetch(ti, [keys[i] for i in idx])):
                datas[i] = d
        ok = 0
        for key, ti, data, block in zip(keys, src, datas, new_blocks):
            for tj in range(ti + 1, len(self.stores)):  # missing or corrupt: try the lower tiers
                if data is not None:
                    break
                data, ti = self._fetch(tj, [key])[0], tj
            if data is None:
                break
            self._loads.append((block.block_id, data))
            self.stats[ti].hit_blocks += 1
            ok += 1
        if ok:
            self.reload_decisions += 1
            self.tier_hit_tokens += ok * self.block_size
        return PrefixHit(hit.blocks, None, 0, (len(hit.blocks) + ok) * self.block_size)

    def _fetch(self, ti: int, keys: list[bytes]) -> list:
        """Verified data of each key from tier ti (None: missing or corrupt, then dropped);
        times the fetch and the checksums into the tier's measured bandwidth."""
        store, s = self.stores[ti], self.stats[ti]
        t0 = time.perf_counter()
        if self._is_down(ti):
            return [None] * len(keys)
        try:
            payloads = store.get_many(keys)
        except Exception:      # noqa: BLE001 -- an unreachable store is a miss, not a failure
            self._mark_down(ti)
            return [None] * len(keys)
        out = [unpack_block(k, p, self.block_bytes, store.verified) for k, p in zip(keys, payloads)]
        dt = time.perf_counter() - t0
        nbytes = 0
        for k, p, d in zip(keys, payloads, out):
            if d is None and p is not None:
                s.corrupt_blocks += 1
                try:
                    store.delete(k)
                except Exception:  # noqa: BLE001
                    pass
            elif d is not None:
                nbytes += len(p)
        if nbytes:
            s.bytes_loaded += nbytes
            bw = nbytes / max(dt, 1e-9)
            s.bandwidth = bw if s.bandwidth is None else 0.8 * s.bandwidth + 0.2 * bw
        return out

    def _is_down(self, ti: int) -> bool:
        return self._down_until[ti] > time.monotonic()

    def _mark_down(self, ti: int) -> None:
        """A store that failed (Redis unreachable) is skipped for RETRY_S seconds: its blocks
        are misses and nothing is saved there, instead of every lookup waiting on it."""
        self._down_until[ti] = time.monotonic() + self.RETRY_S
        self.stats[ti].failures += 1

    def take(self) -> tuple[list, list]:
        """The queued saves [(gpu block, hash, evicted)] and loads [(gpu block, data)]."""
        saves = [(b, h, e) for b, (h, e) in self._saves.items()]
        loads, self._saves, self._loads = self._loads, {}, []
        return saves, loads

    # -- the model runner's side -------------------------------------------------------------
    def attach_runner(self, runner) -> None:
        """Become the runner's connector (its named hook points call this one), size the
        payloads and probe each tier's bandwidth."""
        runner.kv_connector = self
        self.block_bytes = runner.kv_block_bytes()
        self.rule = ReloadRule(self.block_bytes / self.block_size, self.policy)
        for ti in range(len(self.stores)):
            self._probe(ti)

    def after_forward(self, scheduled, seconds: float) -> None:
        """Each forward pass times Theta_prefill for the reload rule."""
        self.rule.observe_forward(scheduled, seconds)

    def _probe(self, ti: int, n: int = 4) -> None:
        """Start-up bandwidth of tier ti: write n random blocks, read and verify them, delete."""
        store, s = self.stores[ti], self.stats[ti]
        try:
            keys = [os.urandom(32) for _ in range(n)]
            store.put_many([(k, pack_block(k, os.urandom(self.block_bytes))) for k in keys])
            store.flush()
            t0 = time.perf_counter()
            got = sum(unpack_block(k, p, self.block_bytes) is not None
                      for k, p in zip(keys, store.get_many(keys)))
            dt = time.perf_counter() - t0
            for k in keys:
                store.delete(k)
        except Exception:      # noqa: BLE001 -- a tier that cannot be probed starts unmeasured
            return
        if got == n:
            s.probe_bandwidth = s.bandwidth = n * (PAYLOAD_OVERHEAD + self.block_bytes) / max(dt, 1e-9)

    def save_blocks(self, runner, saves: list[tuple[int, bytes, bool]]) -> None:
        """Copy the blocks out of the pool and store them: an evicted block into the first tier
        (a CPU tier's overflow moves down), every block into the write-through tiers; a tier
        that already holds a key is not written again."""
        if not saves:
            return
        data = runner.read_kv_blocks([b for b, _, _ in saves])      # [n, block_bytes] uint8
        payloads = {}
        for i, (_, h, _) in enumerate(saves):
            k = self._key(h)
            payloads[h] = (k, pack_block(k, data[i].tobytes()))
        for ti in range(len(self.stores)):
            keys = [h for _, h, evicted in saves
                    if (ti == self._evict_to and evicted) or ti in self._wt]
            self._put(ti, [payloads[h] for h in keys])
        if self._wt:
            for _, h, _ in saves:
                self._written[h] = None
                self._written.move_to_end(h)
            while len(self._written) > self.WRITTEN_MEMORY:
                self._written.popitem(last=False)

    def _put(self, ti: int, items: list[tuple[bytes, bytes]]) -> None:
        """Store items in tier ti (those it lacks); what falls off moves to tier ti + 1."""
        store, s = self.stores[ti], self.stats[ti]
        if self._is_down(ti):
            return
        try:
            have = store.contains_many([k for k, _ in items])
            items = [kv for kv, h in zip(items, have) if not h]
            if not items:
                return
            out = store.put_many(items)
        except Exception:      # noqa: BLE001 -- a failed save loses a cache entry, nothing else
            self._mark_down(ti)
            return
        s.saved_blocks += len(items)
        s.bytes_saved += sum(len(p) for _, p in items)
        if out and ti + 1 < len(self.stores):
            s.demoted_blocks += len(out)
            self._put(ti + 1, out)

    def load_blocks(self, runner, loads: list[tuple[int, bytes]]) -> None:
        """Write verified payload data into fresh pool blocks (before the forward pass)."""
        if not loads:
            return
        load_into(runner, loads, self.block_bytes)

    def flush(self, runner) -> None:
        """Run the saves queued since the last step (blocks labelled by it) and wait for the
        background writers: a server that stops keeps what it computed in its disk tier."""
        saves = [(b, h, e) for b, (h, e) in self._saves.items()]
        self._saves = {}
        self.save_blocks(runner, saves)
        for store in self.stores:
            store.flush()

    def close(self, runner=None) -> None:
        """Flush, then close the stores (idempotent)."""
        if getattr(self, "_closed", False):
            return
        if runner is not None:
            self.flush(runner)
        for store in self.stores:
            store.close()
        self._closed = True

    def stats_dict(self) -> dict:
        rule = self.rule
        tiers = []
        for store, s in zip(self.stores, self.stats):
            nb, nbytes = store.usage()
            tiers.append({"name": store.name, "kind": store.kind, "write_through": store.write_through,
                          "num_blocks": nb, "num_bytes": nbytes, **vars(s),
                          "failures": s.failures + store.failures,    # + the store's own (disk writes)
                          "bytes_refused": store.bytes_refused,
                          "reload_wins": rule.reload_wins(s.bandwidth) if rule else None})
        return {"policy": self.policy, "tiers": tiers, "block_bytes": self.block_bytes,
                "m_kv_bytes_per_token": rule.m_kv if rule else None,
                "prefill_tokens_per_s": rule.prefill_throughput if rule else None,
                "break_even_bandwidth": rule.break_even_bandwidth if rule else None,
                "reload_decisions": self.reload_decisions, "recompute_decisions": self.recompute_decisions,
                "tier_hit_tokens": self.tier_hit_tokens}
