"""Embedding models for `kvserve serve --task embed` (POST /v1/embeddings, server/openai/embeddings.py):
rule.py (how hidden states are pooled: the one place), models.py (which model a path names),
encoder.py (sentence-transformers encoders through transformers), decoder.py (kvserve's Llama
family), batcher.py (one worker thread batching every client's inputs), core.py (the server's
engine for an embedding model)."""
