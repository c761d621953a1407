"""The OpenAI-compatible server: app.py (routes), protocol.py (schemas), metrics.py (Prometheus),
async_engine.py (the engine loop thread), chat.py (chat templates), cli.py (`kvserve serve`)."""
