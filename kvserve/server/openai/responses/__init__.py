"""OpenAI's Responses API over the chat path: routes.py (POST, GET and DELETE /v1/responses),
protocol.py (the request schema), items.py (the response and its output items), streaming.py
(its server-sent events) and store.py (the stored responses, per tenant)."""
