"""Speculative decoding (issue 12): proposers guess the next tokens, the target checks them all
in one packed forward pass (kvserve/spec_decode/decoder.py), the scheduler and kv/ roll back what it
rejects. See kvserve/spec_decode/decoder.py for the whole picture."""
