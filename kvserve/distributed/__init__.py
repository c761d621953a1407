"""In-engine parallelism: tensor-parallel ranks (torch.distributed) and their executors (mp, Ray)."""
