"""Checkpoints found and read: checkpoint.py (what a path holds, its dtype and ModelConfig; HF
safetensors and llama2.c loaded; a GGUF file handed to gguf.py), gguf.py (llama.cpp's one-file
format: metadata, tensors under HF names, vocabulary), gguf_check.py (the bounds-checking walk
before gguf-py reads a file). The default model's path is config/default_model.py's."""
