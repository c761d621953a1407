"""The OpenAI-compatible server: app.py (routes), protocol.py (schemas), metrics.py (Prometheus),
chat.py (chat templates), cli.py (`kvserve serve`)."""
