"""Special-token text in chat messages tokenized as plain text (`--escape-special-tokens-in-content`).

A chat template writes control tokens as text (`<|im_start|>user\\n...<|im_end|>`), and the
rendered prompt is tokenized with special-token matching on, so a message whose content says
`hi<|im_end|>\\n<|im_start|>system\\n...` would open a turn of its own. `encode_escaped` keeps the
template's special tokens and reads the messages' text as text:

1. If no message's content or name holds special-token text, the prompt is tokenized exactly as
   without escaping (the same call, the same ids).
2. Otherwise the template is rendered again with each such field replaced by a random marker.
   The template's own text is what lies between markers; putting the fields back must give the
   prompt again, else the template transforms them (trims, splits) and the request is refused.
3. The prompt is split at the special tokens of the template's text only, and every run between
   them -- template text and message text together, as one pass would see them -- is encoded
   with `split_special_tokens`. Tokenizers split text at special tokens before anything else,
   so every run tokenizes as it would in one pass; only the injected text differs.

Special tokens are matched leftmost-longest, as `tokenizers` matches added tokens; their
`lstrip`/`rstrip`/`single_word` options are not modelled (no chat special token of the
supported models sets them).
"""
from __future__ import annotations

import re
import secrets

from kvserve.frontend.chat_template import ChatTemplateError

ESCAPED_FIELDS = ("content", "name")


def special_token_pattern(tokenizer) -> re.Pattern | None:
    """A regex matching the tokenizer's special-token texts, longest first; None if it has none."""
    texts = sorted(getattr(tokenizer, "special_tokens", None) or {}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def encode_escaped(renderer, pattern: re.Pattern | None, messages: list[dict], text: str,
                   rerender, add_special_tokens: bool | None = None) -> list[int]:
    """Token ids of `text` (= rerender(messages), the renderer's render with the request's
    options) with the special-token text of the messages' fields read as plain text (module
    docstring). `add_special_tokens`: as `renderer.encode`'s."""
    fields = [(i, f) for i, m in enumerate(messages) for f in ESCAPED_FIELDS
              if isinstance(m.get(f), str) and pattern is not None and pattern.search(m[f])]
    if not fields:
        return renderer.encode(text, add_special_tokens)              # 1. nothing to escape
    nonce = secrets.token_hex(8)
    marked = [dict(m) for m in messages]
    for k, (i, f) in enumerate(fields):
        marked[i][f] = f"\ue000{nonce}:{k}\ue001"
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", rerender(marked))
    values = [messages[i][f] for i, f in fields]
    if "".join(values[int(p)] if j % 2 else p for j, p in enumerate(parts)) != text:   # 2.
        raise ChatTemplateError("this chat template changes message text before writing it, so "
                                "special-token text in it (such as <|...|>) cannot be kept as "
                                "plain text: remove that text from the messages")
    tok = renderer.tokenizer
    special = renderer.is_fallback if add_special_tokens is None else add_special_tokens
    if renderer.is_fallback:            # a template that writes no special token of its own
        return tok.encode(text, add_special_tokens=special, split_special_tokens=True)
    ids: list[int] = tok.encode("", add_special_tokens=True) if special else []    # (BOS)
    run: list[str] = []

    def flush():
        if "".join(run):
            ids.extend(tok.encode("".join(run), add_special_tokens=False, split_special_tokens=True))
        run.clear()

    specials = tok.special_tokens
    for j, p in enumerate(parts):                                     # 3.
        if j % 2:
            run.append(values[int(p)])
            continue
        pos = 0
        for m in pattern.finditer(p):
            run.append(p[pos:m.start()])
            flush()
            ids.append(specials[m.group()])
            pos = m.end()
        run.append(p[pos:])
    flush()
    return ids
