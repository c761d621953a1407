"""Checkpoints found and read: checkpoint.py (what a path holds, its dtype and ModelConfig; HF
safetensors and llama2.c loaded; a GGUF file handed to gguf.py), gguf.py (llama.cpp's one-file
format: metadata, tensors under HF names, vocabulary), gguf_file.py (the file itself,
read with every length checked: metadata values and memory-mapped tensors). The default model's path is config/default_model.py's."""
