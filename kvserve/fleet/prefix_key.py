"""The routing key of a request: its leading block hashes, as the engine would label its blocks
(seed 003, "Radix trees": a prefix-aware router; Mooncake's cache-centric scheduling).

The router tokenizes a request the way `kvserve serve` does -- /v1/completions prompts with the
model's tokenizer, /v1/chat/completions messages rendered by the same `ChatRenderer` (the model's
chat template, or `--chat-template`, or the fallback) -- and labels each *full* block with the
engine's own chained hash (`kvserve.kv.prefix_cache.hash_block`), the first block carrying
`first_block_extra(namespace, cache_salt)` exactly as the engine's hash cache does. So two
requests share a routing key prefix only where the engine could share KV blocks, and requests
with different `cache_salt` never match each other (the salt is in the first block's hash, so
it is in every hash of the chain).

Behind `--api-keys` the replicas hash a salt derived from the tenant and the request's
`cache_salt` with the deployment's secret (server/salts.py), which the router holds neither of:
its key salts with the request's `cache_salt` as sent, so it is no longer the replicas' own
chain. Routing needs only that equal requests get equal keys, and they still do (a tenant's
follow-up turns stay on their replica); what is lost is that two tenants sending the same
prefix share a routing key (and the `x-kvserve-prefix-blocks` count of the router's own LRU)
while their replicas keep their blocks apart.

Like the engine's lookup, a key covers at most `(num_tokens - 1) // block_size` blocks (the last
prompt token is always recomputed), and at most `max_blocks` leading blocks (a bound on the
router's work per request; a longer prefix routes like its first `max_blocks` blocks).
"""
from __future__ import annotations

import json
from pathlib import Path

from kvserve.frontend.chat_template import ChatRenderer, ChatTemplateError
from kvserve.kv.prefix_cache import first_block_extra, hash_block

DEFAULT_MAX_BLOCKS = 256


def load_tokenizer(model: str):
    """The kvserve tokenizer of a model path (HF directory, llama2.c directory or GGUF), loading
    no weights where the tokenizer is a file of its own."""
    root = Path(model)
    if root.is_dir() and (root / "tokenizer.json").is_file():
        from kvserve.model.tokenizers.tokenizer import HFTokenizer

        return HFTokenizer(root)
    ggufs = [root] if root.is_file() else sorted(root.glob("*.gguf")) if root.is_dir() else []
    if len(ggufs) == 1 and ggufs[0].suffix == ".gguf":
        from kvserve.model.loaders.gguf import open_gguf, read_metadata
        from kvserve.model.tokenizers.gguf_tokenizer import build_gguf_tokenizer

        return build_gguf_tokenizer(read_metadata(open_gguf(ggufs[0])))
    from kvserve.model.loaders.checkpoint import load_model_dir      # llama2.c: the loader knows it

    return load_model_dir(model)[2]


class RequestHasher:
    """Request body (parsed JSON) -> the leading chained block hashes of its (first) prompt."""

    def __init__(self, tokenizer, block_size: int = 16, namespace: str = "",
                 chat_template: str | None = None, max_blocks: int = DEFAULT_MAX_BLOCKS):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.tokenizer = tokenizer
        self.block_size = block_size
        self.namespace = namespace
        self.max_blocks = max_blocks
        self.chat = ChatRenderer(tokenizer, chat_template) if tokenizer is not None else None

    def block_hashes(self, token_ids, cache_salt: str | None = None) -> list[bytes]:
        """The engine's chained hashes of the full blocks of `token_ids` that a lookup may hit."""
        bs = self.block_size
        n = min((len(token_ids) - 1) // bs, self.max_blocks)
        hashes: list[bytes] = []
        for i in range(max(n, 0)):
            block = token_ids[i * bs:(i + 1) * bs]
            if i == 0:
                hashes.append(hash_block(b"", block, first_block_extra(self.namespace, cache_salt)))
            else:
                hashes.append(hash_block(hashes[-1], block))
        return hashes

    def prompt_ids(self, path: str, body: dict) -> list[int] | None:
        """The token ids the server would prefill for the request's first prompt, or None when
        the router cannot tell (no tokenizer, a malformed body: the replica will answer it)."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if self.chat is None or not isinstance(messages, list) or not messages:
                return None
            rendered = []
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    return None
                rendered.append({"role": m["role"], "content": _content_text(m.get("content")),
                                 **({"name": m["name"]} if m.get("name") else {})})
            try:
                text = self.chat.render(rendered, bool(body.get("add_generation_prompt", True)))
            except ChatTemplateError:
                return None
            return self.chat.encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]          # a batch: route by its first prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if self.tokenizer is not None else None
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None

    def request_hashes(self, path: str, body: dict) -> list[bytes]:
        """The routing key of a request body: [] when there is nothing to match."""
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            return []                   # the replica refuses it with a 400
        try:
            ids = self.prompt_ids(path, body)
        except (ValueError, TypeError, KeyError):
            return []
        return self.block_hashes(ids, salt) if ids else []


def _content_text(content) -> str:
    """A message's text as the server's protocol reads it (a string, or a list of text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else json.dumps(content)
