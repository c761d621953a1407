"""`speculative_config` lives in the config package (kvserve/config/speculative.py); the
speculative decoder's modules import it from here."""
from kvserve.config.speculative import DEFAULT_MAX_BACKOFF_STEPS, KEYS, METHODS, SELF_DRAFTS, SpeculativeConfig

__all__ = ["DEFAULT_MAX_BACKOFF_STEPS", "KEYS", "METHODS", "SELF_DRAFTS", "SpeculativeConfig"]
