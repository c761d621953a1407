"""Sampling: parameters, the batched sampler and (later) speculative decoding."""
