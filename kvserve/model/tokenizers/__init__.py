"""Tokenizers behind one interface: tokenizer.py (the interface, HF tokenizer.json, llama2.c's
tok*.bin) and gguf_tokenizer.py (one rebuilt from a GGUF file's tokenizer.ggml.* metadata)."""
