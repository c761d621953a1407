"""The quantized weight formats kvserve runs: formats.py (kvserve's int8 / int4 weights,
quantized at load, and the quantized `linear`), layouts.py (the bit layouts its int4 / int5 kernels
read), gguf_types.py (a GGUF file's tensor types, Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 ..., decoded into them), gguf_blocks.py (GGUF's block formats held on
the int4 kernel: Q4 values before packing, Q8_0 exactly) and cpu_paths.py (which quantized-matmul
path each step shape takes on this CPU)."""
