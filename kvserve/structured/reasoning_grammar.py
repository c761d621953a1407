"""A constraint that starts after a reasoning model's thought (`--reasoning-parser`): the
constraint's llguidance grammar, preceded by a rule that lets the model think freely up to the
first `</think>` (a lazy lexeme: it ends at the first one), then whitespace, then the constraint.

    deepseek_r1   start: open? thought ws @answer       (the prompt opened the thought)
    qwen3         start: (open thought ws)? @answer     (a thought only if the output opens one)

The markers are text, and also a token where the tokenizer has one: llguidance reads every added
token as special (Qwen3's `<think>` and `</think>` are added tokens), so such a token is not the
text's bytes to a grammar and gets its own alternative (`<[id]>`). Standard library only: the
grammar-check worker (sandbox_worker.py, which imports no kvserve) uses it too.
"""
from __future__ import annotations

import json

START, END = "<think>", "</think>"
LEADS = {"deepseek_r1": "start: open? thought ws @{answer}\n",
         "qwen3": "start: (open thought ws)? @{answer}\n"}


def marker_tokens(ll_tok, markers=(START, END)) -> dict[str, int]:
    """{marker: token id} for the `markers` an llguidance tokenizer has as one special token."""
    found = {}
    for marker in markers if ll_tok is not None else ():
        ids = ll_tok.tokenize_str(marker)
        if len(ids) == 1 and ll_tok.is_special_token(ids[0]):
            found[marker] = ids[0]
    return found


def after_reasoning(grammar: str, parser: str, tokens: dict[str, int] | None = None) -> str:
    """llguidance's grammar `grammar`, constrained only after the thought (a TopLevelGrammar's
    JSON); `tokens`: `marker_tokens` of the tokenizer it is compiled for."""
    tokens = tokens or {}
    rules = [LEADS[parser], 'open: "<think>"' + (f" | <[{tokens[START]}]>" if START in tokens else ""),
             "thought: thought_text" + (f" | free_text <[{tokens[END]}]>" if END in tokens else ""),
             "thought_text[lazy]: /(.|\\n)*<\\/think>/", "free_text: /(.|\\n)*/", "ws: /[ \\t\\r\\n]*/", ""]
    # (llguidance gives a TopLevelGrammar's JSON, or Lark text for a converted GBNF grammar)
    top = json.loads(grammar) if grammar.lstrip().startswith("{") else {"grammars": [{"lark_grammar": grammar}]}
    first = top["grammars"][0]
    name = first.setdefault("name", "answer")
    top["grammars"] = [{"lark_grammar": "\n".join(rules).format(answer=name)}, *top["grammars"]]
    return json.dumps(top)
