"""Programs in front of several servers: the cache-aware router, replicas (local or Ray), the
prefill/decode proxy, the launcher and the circuit breaker."""
