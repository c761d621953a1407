"""Past one process: tensor parallelism (tensor_parallel.py, executor.py) and data-parallel
replicas behind a cache-aware router."""
