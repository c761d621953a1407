"""The frontend: text in, text out -- tokenizing and checks (processor.py), detokenizing, stop
strings and outputs (output_processor.py), and the engine core in-process (llm_engine.py). The
server runs the same pieces around a core in a thread or a process (server/core_client.py)."""
