"""Request sets for the serving benchmark (`kvserve bench serve`).

Four datasets, each a list of *conversations*; a conversation is one or more turns, and every
turn is one HTTP request. Single-turn datasets (random, prefix, jsonl) have one turn each; the
`chat` dataset has several, and the benchmark sends turn k+1 only after turn k's answer arrived,
with the whole history (user turns and the server's own replies) resent, as a chat UI does.

- `random`: prompts of `--random-input-len` tokens and outputs of `--random-output-len` tokens,
  each drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)]. With a tokenizer
  (`--tokenizer PATH`, or `--model` when it is a local directory or .gguf file) a prompt is random
  ordinary token ids, sent as a list of ints on /v1/completions (`--prompt-format token-ids`, the
  default), or text re-encoded until it counts as the requested length (`--prompt-format text`,
  and always on chat); see bench/prompts.py. Without a tokenizer it is random words from a fixed
  list (roughly one token per word for BPE vocabularies), and the server's count shows how far off.
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
import random
from dataclasses import dataclass, field

from kvserve.bench.prompts import PromptMaker, tokenizer_source


@dataclass
class Turn:
    """One request: a completion prompt or one user message of a chat."""
    text: str
    output_len: int
    prompt_len: int          # requested prompt tokens (jsonl: an estimate); the server's usage wins
    messages: list[dict] | None = None   # jsonl chat records: the full message list for this turn
    prompt_token_ids: list[int] | None = None   # sent as the prompt instead of `text` when set
    exact_len: bool = False  # the server must count exactly `prompt_len` tokens (else: warn)


@dataclass
class Conversation:
    turns: list[Turn] = field(default_factory=list)
    system: str | None = None    # chat dataset: optional system prompt sent with every turn


def _draw_len(rng: random.Random, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return max(1, int(mean))
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def prompt_format(args) -> str:
    """'token-ids' or 'text': how the random and prefix datasets send completion prompts."""
    endpoint = getattr(args, "endpoint", "").rstrip("/")
    chat = args.dataset_name == "chat" or endpoint.endswith("chat/completions")
    return "text" if chat or getattr(args, "prompt_format", "token-ids") == "text" else "token-ids"


def build_dataset(args, maker: PromptMaker | None = None) -> list[Conversation]:
    """The benchmark's conversations, deterministic in `args.seed`.

    random/prefix on /v1/completions: token-id prompts (unless `--prompt-format text`) when a
    tokenizer is known, else text fitted to the requested length; both are `exact_len` turns (the
    user asked for these lengths: the report warns when the server counts others). `maker`
    (reseeded here) saves loading the tokenizer again for every pass of a sweep."""
    rng = random.Random(args.seed)              # lengths: the same whatever the prompt format
    prompt_rng = random.Random(f"{args.seed}:prompts")
    name = args.dataset_name
    if maker is None:
        maker = PromptMaker(tokenizer_source(args), prompt_rng)
    else:
        maker.rng = prompt_rng
    ids_mode = prompt_format(args) == "token-ids" and maker.can_make_ids
    # A chat message is wrapped in the model's template, which adds tokens the client cannot
    # count: its content is fitted to the length, and the server's count is only reported.
    chat = getattr(args, "endpoint", "").rstrip("/").endswith("chat/completions")

    def prompt(n: int) -> tuple[str, list[int] | None]:
        if ids_mode:
            ids = maker.make_ids(n)
            return maker.decode(ids), ids
        return maker.make_text(n, with_specials=not chat), None

    n = args.num_prompts
    if name == "random":
        out = []
        for _ in range(n):
            il = _draw_len(rng, args.random_input_len, args.random_range_ratio)
            ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
            text, ids = prompt(il)
            out.append(Conversation([Turn(text, ol, il, prompt_token_ids=ids, exact_len=not chat)]))
        return out
    if name == "prefix":
        if ids_mode:
            prefixes = [maker.make_ids(args.prefix_len) for _ in range(max(1, args.prefix_num_prefixes))]
        else:
            prefixes = [maker.make_text(args.prefix_len) for _ in range(max(1, args.prefix_num_prefixes))]
        out = []
        for i in range(n):
            ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
            want = args.prefix_len + args.prefix_question_len
            if ids_mode:
                ids = prefixes[i % len(prefixes)] + maker.make_ids(args.prefix_question_len)
                out.append(Conversation([Turn(maker.decode(ids), ol, want, prompt_token_ids=ids,
                                              exact_len=True)]))
            else:
                # Text joined at a newline: the server's count may differ by a token or so.
                q = maker.make_text(args.prefix_question_len, with_specials=False)
                out.append(Conversation([Turn(prefixes[i % len(prefixes)] + "\n" + q, ol, want,
                                              exact_len=not chat)]))
        return out
    if name == "chat":
        out = []
        num_conv = args.chat_num_conversations or max(1, n // max(1, args.chat_turns))
        for _ in range(num_conv):
            conv = Conversation(system=maker.make_text(args.prefix_len, False) if args.prefix_len else None)
            for _ in range(args.chat_turns):
                il = _draw_len(rng, args.random_input_len, args.random_range_ratio)
                ol = _draw_len(rng, args.random_output_len, args.random_range_ratio)
                conv.turns.append(Turn(maker.make_text(il, with_specials=False), ol, il))
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
