"""The OpenAI-compatible API: the routes (completions.py, chat.py, responses/, embeddings.py,
tokenizer_routes.py: vLLM's /tokenize and its neighbours), the wire format they read and write
(protocol.py and its field groups: wire_types, request_rules, chat_fields, structured_fields,
tool_fields), and the steps between a request and its answer (chat_renderer, prompts, sampling,
tool_choice, tool_output, logprobs, streaming)."""
