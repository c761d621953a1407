"""Answer caches in front of the model (seed 000, "Semantic caching"): an exact-match cache
keyed on the whole request (exact.py) and a semantic cache that returns the answer of the
nearest past query above a similarity threshold (semantic.py). Both are scoped per tenant and
bounded in time (TTL) and size (LRU). The server's glue is kvserve/server/answers.py."""
