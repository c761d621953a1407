"""Prefix-cache hit rates of a trace under a pool size: vLLM's chained block hashes vs SGLang's radix
tree (seed 000 "Prefix caching"; seed 003 "Reusing the cache across requests", "Chained block
hashes", "Radix trees", and the cell with 120 interleaved chat conversations).

These are analysis models of the two lookups (what hits, what is evicted), not the engine's cache.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_hashes(tokens, block_size: int = 16, extra=()) -> list[str]:
    """Seed 003 `block_hashes`, made real: one SHA-256 hash per *full* block, each chaining the previous
    block's hash, the block's tokens and the extra keys (e.g. a cache salt or adapter id, mixed into
    the first block), so a hash commits to the whole prefix. A trailing partial block gets no hash."""
    out, prev = [], ""
    arr = np.asarray(tokens, dtype=np.int64)
    for j in range(0, len(arr) - block_size + 1, block_size):
        keys = repr(tuple(extra)).encode() if j == 0 else b""
        h = hashlib.sha256(prev.encode() + arr[j:j + block_size].tobytes() + keys).hexdigest()
        out.append(h)
        prev = h
    return out


class HashChainCache:
    """vLLM-style prefix cache model: a pool of `capacity_blocks` blocks, keyed by chained hashes,
    evicted least recently used first; a request's blocks are released tail first (the last block of
    a prefix becomes the oldest), so shared heads survive longest (seed 003)."""

    def __init__(self, capacity_blocks: float, block_size: int = 16):
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.lru: OrderedDict[str, None] = OrderedDict()  # oldest first

    def lookup(self, tokens, hashes=None) -> int:
        """Cached prefix length in tokens: whole blocks up to the first miss, capped so at least the
        last prompt token is recomputed (vLLM caps every hit one token short of the prompt).
        `hashes` may pass block_hashes(tokens[:-1]) precomputed."""
        if hashes is None:
            hashes = block_hashes(tokens[:max(len(tokens) - 1, 0)], self.block_size)
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += self.block_size
        return n

    def insert(self, tokens, hashes=None) -> None:
        """Cache every full block of `tokens` (prompt + generated answer), touched tail first."""
        if hashes is None:
            hashes = block_hashes(tokens, self.block_size)
        for h in reversed(hashes):
            self.lru[h] = None
            self.lru.move_to_end(h)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


class _Node:
    __slots__ = ("key", "children", "parent", "last", "n")

    def __init__(self, key=(), parent=None):
        self.key = key            # the tokens on the edge into this node
        self.children = {}        # first token -> child
        self.parent = parent
        self.last = 0             # last access time
        self.n = len(key)


class RadixCache:
    """Seed 003 `RadixCache`, made real: SGLang's radix tree over token ids; `match` finds the longest
    cached prefix to the token, `insert` adds a sequence sharing common prefixes, and when more than
    `capacity_tokens` are stored the least recently used leaves are evicted first."""

    def __init__(self, capacity_tokens: float = float("inf")):
        self.root = _Node()
        self.capacity = capacity_tokens
        self.size = 0
        self.clock = 0

    def _walk(self, tokens, touch: bool):
        node, i = self.root, 0
        self.clock += 1
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                return node, i, None, 0
            k = 0
            while k < child.n and i + k < len(tokens) and child.key[k] == tokens[i + k]:
                k += 1
            if touch:
                child.last = self.clock
            if k < child.n:
                return node, i + k, child, k
            node, i = child, i + k
        return node, i, None, 0

    def match(self, tokens) -> int:
        """Longest cached prefix of `tokens`, capped one token short of the prompt."""
        tokens = tuple(tokens)
        _, i, _, _ = self._walk(tokens[:max(len(tokens) - 1, 0)], touch=True)
        return i

    def insert(self, tokens) -> int:
        """Insert a token sequence; returns how many of its tokens were already cached."""
        tokens = tuple(tokens)
        node, i, child, k = self._walk(tokens, touch=True)
        matched = i
        if child is not None:  # split the edge at k
            mid = _Node(child.key[:k], node)
            mid.last = self.clock
            node.children[child.key[0]] = mid
            child.key, child.n, child.parent = child.key[k:], child.n - k, mid
            mid.children[child.key[0]] = child
            node = mid
        if i < len(tokens):
            leaf = _Node(tokens[i:], node)
            leaf.last = self.clock
            node.children[tokens[i]] = leaf
            self.size += leaf.n
        self._evict()
        return matched

    def _evict(self) -> None:
        if self.size <= self.capacity:
            return
        leaves = []
        stack = [self.root]
        while stack:
            nd = stack.pop()
            if nd.children:
                stack.extend(nd.children.values())
            elif nd is not self.root:
                leaves.append(nd)
        import heapq
        heap = [(nd.last, id(nd), nd) for nd in leaves]
        heapq.heapify(heap)
        while self.size > self.capacity and heap:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            del parent.children[nd.key[0]]
            self.size -= nd.n
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last, id(parent), parent))


def chat_trace(n_conversations: int = 120, n_system: int = 3, system_len=(600, 2000), turns=(1, 6),
               user_len=(20, 200), answer_len=(50, 400), vocab: int = 32000, seed: int = 0):
    """Seed 003's synthetic chat trace: conversations with one of three system prompts (600 to 2,000
    tokens) and one to six turns, interleaved at random; each turn's prompt resends the system prompt
    and the whole history plus a new user message. User-message and answer lengths are not given by
    the seed: uniform 20-200 and 50-400 tokens (assumptions). Returns [(prompt, answer)] in order."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, vocab, int(rng.integers(system_len[0], system_len[1] + 1))))
               for _ in range(n_system)]
    convs = []
    for _ in range(n_conversations):
        history = list(systems[int(rng.integers(n_system))])
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        conv = []
        for _ in range(n_turns):
            prompt = history + list(rng.integers(0, vocab, int(rng.integers(user_len[0], user_len[1] + 1))))
            answer = list(rng.integers(0, vocab, int(rng.integers(answer_len[0], answer_len[1] + 1))))
            conv.append((prompt, answer))
            history = prompt + answer
        convs.append(conv)
    # interleave at random, keeping each conversation's turns in order
    order = np.concatenate([[c] * len(conv) for c, conv in enumerate(convs)])
    rng.shuffle(order)
    pos = [0] * len(convs)
    trace = []
    for c in order:
        trace.append(convs[c][pos[c]])
        pos[c] += 1
    return trace


def trace_hashes(trace, block_size: int = 16) -> list[tuple[list[str], list[str]]]:
    """Block hashes of each (prompt minus its last token, prompt + answer) of a trace, computed once
    so that several pool sizes can replay the same trace cheaply."""
    return [(block_hashes(p[:max(len(p) - 1, 0)], block_size), block_hashes(list(p) + list(a), block_size))
            for p, a in trace]


def prefix_hit_rate(trace, cache, hashes=None) -> dict:
    """Replay a trace of (prompt, answer) pairs through a cache (HashChainCache or RadixCache): each
    prompt looks up its cached prefix, then prompt + answer is cached as it is generated. Returns the
    share of prompt tokens that hit. `hashes`: trace_hashes(trace) for a HashChainCache, optional."""
    hit = total = 0
    for i, (prompt, answer) in enumerate(trace):
        if isinstance(cache, RadixCache):
            hit += cache.match(prompt)
            cache.insert(list(prompt) + list(answer))
        else:
            look, ins = hashes[i] if hashes is not None else (None, None)
            hit += cache.lookup(prompt, look)
            cache.insert(list(prompt) + list(answer), ins)
        total += len(prompt)
    return {"hit_tokens": hit, "prompt_tokens": total, "hit_rate": hit / total if total else 0.0}


def hit_rate_curve(trace, pool_tokens, block_size: int = 16) -> list[dict]:
    """Hit rates of hash-chain and radix caches at each pool size (tokens; inf = unlimited)."""
    rows = []
    hashes = trace_hashes(trace, block_size)
    for cap in pool_tokens:
        hc = prefix_hit_rate(trace, HashChainCache(cap / block_size, block_size), hashes)["hit_rate"]
        rx = prefix_hit_rate(trace, RadixCache(cap))["hit_rate"]
        rows.append({"pool_tokens": cap, "hash_chain": hc, "radix": rx})
    return rows
