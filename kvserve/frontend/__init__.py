"""The frontend: text in, text out -- tokenizing and checks (processor.py), detokenizing, stop
strings and outputs (output_processor.py), and the engine core in-process (llm_engine.py) or
behind a thread or process boundary (core_client.py)."""
