"""Paged KV cache bookkeeping: the block pool and the per-request block tables."""
