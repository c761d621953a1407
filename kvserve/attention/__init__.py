"""Attention over the paged KV cache: one interface (backend.py), the step's metadata
(metadata.py), the backends (torch_paged.py: portable torch, CPU and CUDA; cpu_fused.py: kvserve's
C++ decode kernels), the KV cache's storage formats (kv_quant.py), and the one selection point
(selector.py: `--attention-backend`, "auto" decided once per model). A new backend is one module
and one line in selector.BACKENDS."""
