"""Radix-tree prefix cache (seed 003, "Radix trees"; SGLang's RadixAttention over pages).

The tree holds token sequences; every edge is one page-aligned run of `block_size` tokens whose
K/V live in one physical block (SGLang's paged radix tree: page-aligned keys, one page per node),
and a *partial* leaf holds fewer than `block_size` tokens: the unfinished last block of a request
that has left. Matching is token-granular: full blocks are followed exactly (one dict lookup per
block), then the next, incomplete run is matched against the children that start with the same
token, and the best common prefix (full child or partial leaf) is reused by *copying* its block
into a fresh one, since the new request will write the rest of that block.

Locking is the pool's reference count: a request holding a matched path keeps every block on it
at ref_cnt > 0, so none of it can be evicted. Unreferenced blocks wait in the pool's LRU free
queue; because a request releases its blocks tail first and every holder of a node also holds
the node's ancestors, a node always joins the free queue before its parent does, and eviction
(least recently freed first) takes leaves first. Should a node with descendants be evicted
anyway, its whole subtree is unlabelled so the tree never points at reused blocks.

Requests with different `cache_salt` (or model namespace) live under different roots; a root
is made only when a block is labelled under it and dropped when its last child goes, so lookups
with many salts leave nothing behind.
"""
from __future__ import annotations

from kvserve.kv.block_pool import BlockPool, KVBlock
from kvserve.kv.prefix_cache import NO_HIT, PrefixCache, PrefixHit, SeqCacheState, first_block_extra

RADIX_LABEL = b"radix"


class RadixNode:
    __slots__ = ("key", "block", "parent", "children", "by_first", "alive")

    def __init__(self, key: tuple = (), block: KVBlock | None = None, parent: "RadixNode | None" = None):
        self.key = key                              # the tokens of this node's block (len <= block_size)
        self.block = block
        self.parent = parent
        self.children: dict[tuple, RadixNode] = {}  # key -> child
        self.by_first: dict[int, list[RadixNode]] = {}  # first token -> children (partial matching)
        self.alive = True

    def add(self, child: "RadixNode") -> None:
        self.children[child.key] = child
        self.by_first.setdefault(child.key[0], []).append(child)

    def remove(self, child: "RadixNode") -> None:
        del self.children[child.key]
        lst = self.by_first[child.key[0]]
        lst.remove(child)
        if not lst:
            del self.by_first[child.key[0]]


def _lcp(a: tuple, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixPrefixCache(PrefixCache):
    kind = "radix"

    def __init__(self, pool: BlockPool, block_size: int, namespace: str = ""):
        super().__init__(pool, block_size, namespace)
        self.roots: dict[bytes, RadixNode] = {}
        self.nodes: dict[int, RadixNode] = {}       # block_id -> node
        self.num_subtree_evictions = 0

    # -- helpers ---------------------------------------------------------------------------
    def _root(self, req, create: bool = True) -> RadixNode | None:
        extra = first_block_extra(self.namespace, req.cache_salt)
        root = self.roots.get(extra)
        if root is None and create:
            root = self.roots[extra] = RadixNode(extra)     # a root's key is its salt key
        return root

    def _detach(self, node: RadixNode) -> None:
        """Take `node` out of its parent; a root left without children is dropped."""
        parent = node.parent
        parent.remove(node)
        node.alive = False
        if parent.parent is None and not parent.children and self.roots.get(parent.key) is parent:
            del self.roots[parent.key]
            parent.alive = False

    def _key(self, req, st: SeqCacheState, i: int) -> tuple:
        keys, bs = st.block_keys, self.block_size
        while len(keys) <= i:
            j = len(keys)
            keys.append(tuple(req.token_ids[j * bs:(j + 1) * bs]))
        return keys[i]

    def eligible_tokens(self, req) -> int:
        return req.num_tokens - 1

    # -- lookup ----------------------------------------------------------------------------
    def match(self, req, st: SeqCacheState) -> PrefixHit:
        node = self._root(req, create=False) if self.nodes else None
        if node is None:
            return NO_HIT
        bs, limit = self.block_size, req.num_tokens - 1
        blocks = []
        i = 0
        while (i + 1) * bs <= limit:
            child = node.children.get(self._key(req, st, i))
            if child is None:
                break
            blocks.append(child.block)
            node = child
            i += 1
        rest = req.token_ids[i * bs:min((i + 1) * bs, limit)]
        best, best_len = None, 0
        if rest:
            for child in node.by_first.get(rest[0], ()):
                n = _lcp(child.key, rest)
                if n > best_len:
                    best, best_len = child, n
        if not blocks and best is None:
            return NO_HIT
        return PrefixHit(blocks, best.block if best is not None else None, best_len,
                         len(blocks) * bs + best_len)

    # -- insertion -------------------------------------------------------------------------
    def _label(self, node: RadixNode) -> None:
        node.block.block_hash = RADIX_LABEL
        self.nodes[node.block.block_id] = node

    def _unlabel_partial(self, block: KVBlock) -> None:
        node = self.nodes.pop(block.block_id)
        self._detach(node)
        block.block_hash = None

    def cache_full_blocks(self, req, st: SeqCacheState, blocks: list[KVBlock]) -> None:
        bs = self.block_size
        n_full = min(req.num_computed_tokens // bs, len(blocks))
        start = st.num_labelled_blocks
        if n_full <= start:
            return
        node = st.radix_node
        if node is None or not node.alive or start == 0:
            node, start = self._root(req), 0
        for i in range(start, n_full):
            key = self._key(req, st, i)
            child = node.children.get(key)
            if child is None:
                b = blocks[i]
                if b.block_hash is not None:
                    existing = self.nodes.get(b.block_id)
                    if existing is not None and len(existing.key) < bs:
                        self._unlabel_partial(b)     # a partial leaf its holder has now filled
                    else:
                        # Labelled elsewhere (cannot happen by the prefix property); stay unlabelled.
                        st.num_labelled_blocks, st.radix_node = i, node
                        if node.parent is None and not node.children:
                            del self.roots[node.key]
                            node.alive = False
                        return
                child = RadixNode(key, b, node)
                node.add(child)
                self._label(child)
            node = child
        st.num_labelled_blocks, st.radix_node = n_full, node

    def cache_partial_block(self, req, st: SeqCacheState, blocks: list[KVBlock]) -> None:
        bs = self.block_size
        n = req.num_computed_tokens
        k, r = divmod(n, bs)
        if r == 0 or k >= len(blocks):
            return
        self.cache_full_blocks(req, st, blocks)
        if st.num_labelled_blocks != k:
            return
        if k:
            node = st.radix_node
            if node is None or not node.alive:
                return
        else:
            node = self._root(req, create=False)
        b = blocks[k]
        if b.block_hash is not None:
            return
        key = tuple(req.token_ids[k * bs:n])
        if node is not None:
            for child in node.by_first.get(key[0], ()):
                if child.key[:r] == key:
                    return       # already covered by a cached block
        else:
            node = self._root(req)
        child = RadixNode(key, b, node)
        node.add(child)
        self._label(child)

    # -- eviction --------------------------------------------------------------------------
    def _evict(self, block: KVBlock) -> None:
        node = self.nodes.pop(block.block_id, None)
        if node is None:
            return
        self._detach(node)
        if node.children:
            self.num_subtree_evictions += 1
            stack = list(node.children.values())
            while stack:
                d = stack.pop()
                d.alive = False
                self.nodes.pop(d.block.block_id, None)
                d.block.block_hash = None
                stack.extend(d.children.values())

    @property
    def num_cached_blocks(self) -> int:
        return len(self.nodes)

    def check_integrity(self) -> None:
        for key, root in self.roots.items():
            assert root.alive and root.key == key and root.parent is None
            assert root.children, "a radix root without children is kept"
        for bid, node in self.nodes.items():
            assert node.alive and node.block.block_id == bid and node.block.block_hash == RADIX_LABEL
            assert node.parent.children.get(node.key) is node, "radix node detached from its parent"
            assert 0 < len(node.key) <= self.block_size
