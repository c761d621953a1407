"""Models: the Llama-family forward pass and its contracts -- llama.py, layers.py, config.py
(ModelConfig), registry.py (architecture name -> model class), sharding.py (tensor-parallel
slices), fusion.py (the weights from a checkpoint's parts), fused_decode.py (the fused decode
step) -- and, each on its own floor: loaders/ (checkpoints read: HF safetensors, llama2.c, GGUF;
the default model), quant/ (the quantized weight formats kvserve runs, and which CPU path runs
them) and tokenizers/ (HF tokenizer.json, llama2.c's, one rebuilt from GGUF metadata)."""
