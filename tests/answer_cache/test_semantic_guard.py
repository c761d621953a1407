"""The semantic cache's near-miss guard (kvserve/answer_cache/near_miss.py, issue 26): the three
findings are misses at the default operating point (and hits without the guard, as they were),
paraphrases still hit, and "serve from cache" keeps precision >= 0.99 on the 375 labelled pairs
of tests/answer_cache/pairs_hard.py, with the real all-MiniLM-L6-v2."""
from __future__ import annotations

import pytest

from kvserve.answer_cache.near_miss import near_miss
from kvserve.answer_cache.semantic import DEFAULT_THRESHOLD, SemanticCache
from tests.answer_cache.conftest import unit
from tests.answer_cache.pairs_hard import HELD_OUT, LABELLED

FINDINGS = [    # (cached, asked): the answers differ, the embeddings barely
    ("Is it safe to mix bleach and ammonia?", "Is it unsafe to mix bleach and ammonia?"),      # 0.991
    ("What is 17 times 23?", "What is 17 times 24?"),                                          # 0.911
    ("How do I convert a string to an integer in Python?",
     "How do I convert an integer to a string in Python?"),                                    # 0.996
    ("string to integer", "integer to string"),                                                # 0.993
]
PARAPHRASES = [
    ("How do I delete a file?", "How can I remove a file?"),
    ("Is it not safe to mix bleach and ammonia?", "Is it unsafe to mix bleach and ammonia?"),
    ("How many miles is 10 kilometers?", "What is 10 km in miles?"),
    ("What is the capital of Japan?", "Which city is Japan's capital?"),
    ("What is 12 times 12?", "What is twelve times twelve?"),
    ("How do I convert an integer to a string in Python?", "How to turn an int into a string in Python?"),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?"),
    ("What is the difference between TCP and UDP?", "What is the difference between UDP and TCP?"),
    ("How do I print without a newline in Python?", "How can I print in Python with no newline?"),
]


@pytest.fixture(scope="module")
def vectors(embedder):
    """query -> its embedding, for every query of the labelled set."""
    texts = sorted({q for a, b, _, _ in LABELLED for q in (a, b)} | {q for p in FINDINGS + PARAPHRASES for q in p})
    return dict(zip(texts, embedder(texts)))


def served(vectors, cached: str, asked: str, **kw):
    cache = SemanticCache(**kw)
    cache.insert("scope", vectors[cached], f"answer to {cached}", cached)
    return cache.lookup("scope", vectors[asked], asked)


def precision_recall(vectors, pairs, **kw):
    hits = [same for a, b, same, _ in pairs if served(vectors, a, b, **kw)]
    return sum(hits) / max(1, len(hits)), sum(hits) / sum(p[2] for p in pairs), len(hits) - sum(hits)


def test_findings_miss_now_and_hit_without_the_guard(vectors):
    for cached, asked in FINDINGS:
        assert served(vectors, cached, asked) is None, asked
        unguarded = served(vectors, cached, asked, guard=False)          # the cache as it was
        assert unguarded is not None and unguarded.similarity >= DEFAULT_THRESHOLD, asked


def test_paraphrases_still_hit(vectors):
    for cached, asked in PARAPHRASES:
        m = served(vectors, cached, asked)
        assert m is not None and m.value == f"answer to {cached}", asked


def test_precision_on_the_labelled_pairs(vectors):
    assert len(LABELLED) >= 200
    p, r, wrong = precision_recall(vectors, LABELLED)
    p0, r0, wrong0 = precision_recall(vectors, LABELLED, guard=False)
    print(f"\nguard: precision {p:.3f} recall {r:.3f} ({wrong} wrong); "
          f"no guard: precision {p0:.3f} recall {r0:.3f} ({wrong0} wrong)")
    assert p >= 0.99 and r >= 0.7
    assert p0 < 0.7 and wrong0 > 50 * wrong              # the threshold alone serves wrong answers
    ph, rh, _ = precision_recall(vectors, HELD_OUT)      # pairs the guard was not tuned on
    assert ph >= 0.97 and rh >= 0.7


def test_a_near_miss_falls_through_to_the_next_neighbour():
    pytest.importorskip("faiss")
    c = SemanticCache(threshold=0.9)
    c.insert("s", unit(1, 0), "391", "What is 17 times 23?")
    c.insert("s", unit(1, 0.3), "408", "What is 17 multiplied by 24?")
    m = c.lookup("s", unit(1, 0.05), "What is 17 times 24?")     # nearest: 17 times 23
    assert m.value == "408" and c.near_misses == 1
    assert c.lookup("s", unit(1, 0.05), "What is 17 times 25?") is None and c.near_misses == 3
    c.insert("s", unit(0, 1), "?")                                # no query text: never served
    assert c.lookup("s", unit(0, 1), "anything") is None
    with pytest.raises(ValueError, match="query text"):
        c.lookup("s", unit(1, 0))
    assert SemanticCache(threshold=0.9, guard=False).lookup("s", unit(1, 0)) is None


@pytest.mark.parametrize("cached, asked, reason", [
    ("What is 17 x 23?", "What's seventeen times twenty-three?", None),
    ("How many seconds are in an hour?", "How many seconds does one hour have?", None),
    ("What is the second law of thermodynamics?", "What is the 2nd law of thermodynamics?", None),
    ("What is 9 squared?", "What is 9 to the power of 2?", None),
    ("What is 10 minus 3?", "What is 3 minus 10?", "number"),
    ("What is 60 mph in km/h?", "What is 60 km/h in mph?", "number"),
    ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
    ("Why can't I connect?", "Why can I connect?", "negation"),
    ("How do I encrypt a file?", "How do I decrypt a file?", "negation"),
    ("How do I lock my screen?", "How do I unlock my screen?", "negation"),
    ("How do I sort in ascending order?", "How do I sort in descending order?", "contrary"),
    ("What is the capital of Australia?", "What is the capital of Austria?", "entity"),
    ("What is the capital of France?", "What is france's capital?", None),
    ("How do I redirect HTTP to HTTPS?", "How do I redirect HTTPS to HTTP?", "order"),
    ("How many bytes are in a kilobyte?", "How many bytes are in a megabyte?", "unit"),
    ("What year did the Titanic sink?", "When did the Titanic sink?", None),
    ("Is Python faster than Java?", "Is Java faster than Python?", "order"),
    ("Why do dogs chase cats?", "Why do cats chase dogs?", "order"),
    ("Can dogs eat chocolate?", "Is chocolate safe for dogs to eat?", None),
    ("How far is the Moon from the Earth?", "What is the distance to the Moon from the Earth?", None),
])
def test_near_miss(cached, asked, reason):
    assert near_miss(cached, asked) == reason
    assert near_miss(asked, cached) == reason                     # symmetric
