"""The HTTP server: app.py (build_app, the server's own routes), cli.py (`kvserve serve`), and what
every route shares -- core_client.py (the engine core, in a thread or a process), body.py, errors.py,
limits.py, submission.py + collector.py, tenants.py + salts.py, answers.py (the answer-cache front),
metrics.py, request_log.py, shutdown.py, openapi.py, page.py + ui/ (the chat page). The
OpenAI-compatible API itself is openai/."""
