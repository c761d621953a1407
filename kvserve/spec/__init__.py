"""Speculative decoding (issue 12): proposers guess the next tokens, the target checks them all
in one packed forward pass (kvserve/spec/decoder.py), the scheduler and kv/ roll back what it
rejects. See kvserve/spec/decoder.py for the whole picture."""
