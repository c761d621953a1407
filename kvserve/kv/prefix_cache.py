"""Automatic prefix caching with chained block hashes (seed 003, "Reusing the cache across
requests", "Chained block hashes", "Who may share a cache"; seed 000, "Prefix caching").

Every *full* block of a sequence is labelled by SHA-256 over (the previous block's hash, the
block's token ids, extra keys). The first block's extra keys hold the cache namespace (model and
dtype) and the request's `cache_salt`, so requests with different salts never share a block and
a hash commits to the whole prefix before it. A lookup walks the prompt's hashes from the start
and stops at the first miss; it is capped one token short of the prompt, because the first output
token is sampled from the last prompt token's logits, which the cache does not store (a fully
cached, block-aligned prompt therefore recomputes its whole last block, as in vLLM).

Labelled blocks of finished requests stay in the pool's free queue, still labelled: a hit pulls
one out in O(1) (`BlockPool.touch`), and reuse for new contents evicts the label
(`BlockPool.on_evict`), least recently freed first. Requests release their blocks tail first, so
the shared heads of prefixes are evicted last.

`PrefixCache` is the interface shared with the radix tree (`radix_cache.RadixPrefixCache`);
`kv/manager.py` chooses between them. A sequence's labelling progress (`SeqCacheState`) is
owned by the KV manager, keyed by request id; the caches read a request's tokens, never write it.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from kvserve.kv.block_pool import BlockPool, KVBlock


@dataclass
class PrefixHit:
    """What a lookup found: blocks shared in place, and (radix only) a block whose first
    `copy_len` slots match the next tokens, to be copied into a fresh block."""

    blocks: list[KVBlock] = field(default_factory=list)
    copy_src: KVBlock | None = None
    copy_len: int = 0
    num_tokens: int = 0          # cached tokens: len(blocks) * block_size + copy_len


NO_HIT = PrefixHit()


@dataclass
class SeqCacheState:
    """One sequence's prefix-cache progress: chained hashes (hash cache) or block keys and the
    deepest labelled node (radix tree), computed once per block and kept across steps."""

    block_hashes: list[bytes] = field(default_factory=list)
    block_keys: list[tuple] = field(default_factory=list)
    num_labelled_blocks: int = 0
    radix_node: object = None

    def reset(self) -> None:
        """The sequence's blocks were dropped or replaced (preemption, swap in): relabel from 0."""
        self.num_labelled_blocks = 0
        self.radix_node = None

    def fork(self) -> "SeqCacheState":
        return SeqCacheState(list(self.block_hashes), list(self.block_keys),
                             self.num_labelled_blocks, self.radix_node)


def first_block_extra(namespace: str, cache_salt: str | None) -> bytes:
    """Extra keys mixed into the first block's hash: the model namespace and the cache salt."""
    return b"\x00ns:" + namespace.encode() + b"\x00salt:" + (cache_salt or "").encode()


def hash_block(parent: bytes, tokens, extra: bytes = b"") -> bytes:
    """SHA-256 over (parent hash, token ids as int64, extra keys): the chained block hash."""
    return hashlib.sha256(parent + array("q", tokens).tobytes() + extra).digest()


class PrefixCache:
    """The interface of both prefix caches. `req` is read (token ids, salt, progress), `st` is
    the sequence's `SeqCacheState`."""

    kind = "none"

    def __init__(self, pool: BlockPool, block_size: int, namespace: str = ""):
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace
        pool.on_evict = self._evict

    def match(self, req, st: SeqCacheState) -> PrefixHit:
        """Longest cached prefix of req.token_ids, capped at num_tokens - 1. Changes no block
        and no tree node (it may memoize hashes in `st`)."""
        raise NotImplementedError

    def eligible_tokens(self, req) -> int:
        """The most this cache could ever hit for req (the block-size floor, the last-token cap)."""
        raise NotImplementedError

    def cache_full_blocks(self, req, st: SeqCacheState, blocks: list[KVBlock]) -> None:
        """Label the request's newly computed full blocks."""
        raise NotImplementedError

    def cache_partial_block(self, req, st: SeqCacheState, blocks: list[KVBlock]) -> None:
        """Called before a request's blocks are released (the radix tree keeps the partial tail)."""

    @property
    def num_cached_blocks(self) -> int:
        raise NotImplementedError

    def _evict(self, block: KVBlock) -> None:
        raise NotImplementedError

    def check_integrity(self) -> None:
        pass


class HashPrefixCache(PrefixCache):
    """vLLM's automatic prefix caching: a dict from chained block hash to physical block."""

    kind = "hash"

    def __init__(self, pool: BlockPool, block_size: int, namespace: str = ""):
        super().__init__(pool, block_size, namespace)
        self.cached: dict[bytes, KVBlock] = {}

    def hashes(self, req, st: SeqCacheState, n_blocks: int) -> list[bytes]:
        """The first `n_blocks` chained hashes of req.token_ids, computed once per block."""
        hs, bs, toks = st.block_hashes, self.block_size, req.token_ids
        while len(hs) < n_blocks:
            i = len(hs)
            if i == 0:
                hs.append(hash_block(b"", toks[:bs], first_block_extra(self.namespace, req.cache_salt)))
            else:
                hs.append(hash_block(hs[-1], toks[i * bs:(i + 1) * bs]))
        return hs

    def eligible_tokens(self, req) -> int:
        return (req.num_tokens - 1) // self.block_size * self.block_size

    def match(self, req, st: SeqCacheState) -> PrefixHit:
        n = (req.num_tokens - 1) // self.block_size
        if n <= 0 or not self.cached:
            return NO_HIT
        blocks = []
        for h in self.hashes(req, st, n)[:n]:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        if not blocks:
            return NO_HIT
        return PrefixHit(blocks, None, 0, len(blocks) * self.block_size)

    def cache_full_blocks(self, req, st: SeqCacheState, blocks: list[KVBlock]) -> None:
        n_full = min(req.num_computed_tokens // self.block_size, len(blocks))
        start = st.num_labelled_blocks
        if n_full <= start:
            return
        hs = self.hashes(req, st, n_full)
        for i in range(start, n_full):
            b, h = blocks[i], hs[i]
            if b.block_hash is None and h not in self.cached:
                b.block_hash = h
                self.cached[h] = b
        st.num_labelled_blocks = n_full

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def _evict(self, block: KVBlock) -> None:
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]

    def check_integrity(self) -> None:
        for h, b in self.cached.items():
            assert b.block_hash == h, f"block {b.block_id} is cached under a hash it does not carry"

