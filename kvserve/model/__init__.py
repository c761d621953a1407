"""Models: loading (HF safetensors, llama2.c), the Llama-family forward pass, attention backends."""
