"""Request sets for the serving benchmark (`kvserve bench serve`).

Four datasets, each a list of *conversations*; a conversation is one or more turns, and every
turn is one HTTP request. Single-turn datasets (random, prefix, jsonl) have one turn each; the
`chat` dataset has several, and the benchmark sends turn k+1 only after turn k's answer arrived,
with the whole history (user turns and the server's own replies) resent, as a chat UI does.

- `random`: prompts of `--random-input-len` tokens and outputs of `--random-output-len` tokens,
  each drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]. With a tokenizer
  (`--tokenizer DIR`, or `--model` when it is a local directory holding `tokenizer.json`) the
  prompt is decoded from random token ids, as vLLM's benchmark does; without one it is random
  words from a fixed list (roughly one token per word for BPE vocabularies).
- `prefix`: `--prefix-num-prefixes` shared system prompts of `--prefix-len` tokens, each request
  one of them (round robin) followed by a distinct question of `--prefix-question-len` tokens:
  the workload prefix caching is for.
- `chat`: `--chat-num-conversations` conversations of `--chat-turns` user turns of
  `--random-input-len` tokens each.
- `jsonl`: one JSON object a line: `{"prompt": "...", "output_len": 128}` or
  `{"messages": [{"role": "user", "content": "..."}], "output_len": 128}`; `output_len`
  (or `max_tokens`) is optional and defaults to `--random-output-len`.
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

# A fixed, boring vocabulary for prompts when no tokenizer is available. Common short English
# words are single tokens in nearly every BPE vocabulary, so word count ~ token count.
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three little girl boy dog cat tree sun "
    "happy big small red blue green play park ball friend mom dad home school bird fish cake"
).split()


@dataclass
class Turn:
    """One request: a completion prompt or one user message of a chat."""
    text: str
    output_len: int
    prompt_len: int          # estimated prompt tokens; the server's usage count wins when present
    messages: list[dict] | None = None   # jsonl chat records: the full message list for this turn


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    system: str | None = None    # chat dataset: optional system prompt sent with every turn


class PromptMaker:
    """Makes prompt text of about `n` tokens, from a tokenizer when one is available."""

    def __init__(self, tokenizer_dir: str | None, rng: random.Random):
        self.rng = rng
        self.tokenizer = None
        self.ids: list[int] = []
        if tokenizer_dir:
            path = os.path.join(tokenizer_dir, "tokenizer.json")
            if os.path.isfile(path):
                from tokenizers import Tokenizer
                self.tokenizer = Tokenizer.from_file(path)
                special = _special_ids(self.tokenizer)
                # Ordinary tokens only: no specials, no byte-fallback pieces (<0x0A>), which
                # decode to replacement characters and re-tokenize to more tokens.
                self.ids = sorted(i for t, i in self.tokenizer.get_vocab().items()
                                  if i not in special and not (t.startswith("<0x") and t.endswith(">")))

    def make(self, n: int) -> str:
        n = max(1, n)
        if self.tokenizer is not None:
            return self.tokenizer.decode([self.rng.choice(self.ids) for _ in range(n)])
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))


def _special_ids(tok) -> set[int]:
    try:
        return set(tok.get_added_tokens_decoder().keys())
    except AttributeError:          # older `tokenizers`
        return set()


def _draw_len(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return max(1, int(mean))
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def build_dataset(args) -> list[Conversation]:
    """The benchmark's conversations, deterministic in `args.seed`."""
    rng = random.Random(args.seed)
    name = args.dataset_name
    tok_dir = args.tokenizer or (args.model if args.model and os.path.isdir(args.model) else None)
    maker = PromptMaker(tok_dir, rng)
    n = args.num_prompts
    if name == "random":
        out = []
        for _ in range(n):
            il = _draw_len(rng, args.random_input_len, args.random_range_ratio)
            ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
            out.append(Conversation([Turn(maker.make(il), ol, il)]))
        return out
    if name == "prefix":
        prefixes = [maker.make(args.prefix_len) for _ in range(max(1, args.prefix_num_prefixes))]
        out = []
        for i in range(n):
            q = maker.make(args.prefix_question_len)
            ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
            text = prefixes[i % len(prefixes)] + "\n" + q
            out.append(Conversation([Turn(text, ol, args.prefix_len + args.prefix_question_len)]))
        return out
    if name == "chat":
        out = []
        num_conv = args.chat_num_conversations or max(1, n // max(1, args.chat_turns))
        for _ in range(num_conv):
            conv = Conversation(system=maker.make(args.prefix_len) if args.prefix_len else None)
            for _ in range(args.chat_turns):
                il = _draw_len(rng, args.random_input_len, args.random_range_ratio)
                ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
                conv.turns.append(Turn(maker.make(il), ol, il))
            out.append(conv)
        return out
    if name == "jsonl":
        if not args.dataset_path:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE.jsonl")
        out = []
        with open(args.dataset_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                rec = json.loads(line)
                ol = int(rec.get("output_len", rec.get("max_tokens", args.random_output_len)))
                if "messages" in rec:
                    text = "\n".join(str(m.get("content", "")) for m in rec["messages"])
                    out.append(Conversation([Turn(text, ol, len(text.split()), rec["messages"])]))
                elif "prompt" in rec:
                    text = rec["prompt"]
                    out.append(Conversation([Turn(text, ol, len(text.split()))]))
                else:
                    raise ValueError(f"{args.dataset_path}:{lineno}: a record needs 'prompt' or 'messages'")
        if n and n < len(out):
            out = out[:n]
        return out
    raise ValueError(f"unknown dataset {name!r}; use random, prefix, chat or jsonl")
