"""Tokenizers behind one small interface: HF `tokenizer.json` (via `tokenizers`) and llama2.c's
`tok*.bin` (sentencepiece-BPE by scores, byte fallback; layout in stories260K/FORMAT.md)."""
from __future__ import annotations

import json
import struct
from functools import cached_property
from pathlib import Path


class Tokenizer:
    """What the engine needs of a tokenizer."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    add_bos_token: bool = True
    special_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `split_special_tokens` (transformers' name) reads special-token
        text such as `<|im_end|>` as plain text instead of as the control token."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text that encodes to a special token -> its id (none: specials are never read from text)."""
        return {}

    _anchor: list[int] | None = None
    _anchor_len = 0

    def token_to_text(self, token_id: int) -> str:
        """The text a token adds after other text (for logprob tables): decoded after an anchor
        token, so that a leading space survives decoders that strip the first one."""
        if self._anchor is None:
            self._anchor = self.encode("a", add_special_tokens=False)[-1:]
            self._anchor_len = len(self.decode(self._anchor, skip_special_tokens=False))
        return self.decode(self._anchor + [token_id], skip_special_tokens=False)[self._anchor_len:]


class TokenizersBacked(Tokenizer):
    """A Tokenizer over a `tokenizers.Tokenizer` (`self._tok`): its special added tokens are
    matched in text, unless `split_special_tokens`, which encodes with a copy of it that has
    `encode_special_tokens` set (made on first use)."""

    _tok = None

    @cached_property
    def _plain_tok(self):
        plain = type(self._tok).from_str(self._tok.to_str())
        plain.encode_special_tokens = True
        return plain

    def _inner(self, split_special_tokens: bool):
        return self._plain_tok if split_special_tokens else self._tok

    @cached_property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}


class HFTokenizer(TokenizersBacked):
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def token_str(value):
            return value.get("content") if isinstance(value, dict) else value

        self.bos_token = token_str(cfg.get("bos_token"))
        self.eos_token = token_str(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        self.chat_template = template
        self.special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        # Some tokenizer.json files lack the BOS post-processor that tokenizer_config asks for.
        probe = self._tok.encode("a", add_special_tokens=True).ids
        self._prepend_bos = bool(cfg.get("add_bos_token", False) and self.bos_token_id is not None
                                 and (not probe or probe[0] != self.bos_token_id))

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt
        # tokenized on a worker thread (server/limits.py) does not stall the other threads.
        tok = self._inner(split_special_tokens)
        ids = tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


class Llama2cTokenizer(Tokenizer):
    """llama2.c's tokenizer: run.c's `encode` (dummy-prefix space, codepoints or byte fallback,
    greedy best-score merges, leftmost on ties) and `decode`."""

    def __init__(self, path: Path, vocab_size: int):
        data = path.read_bytes()
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        off = 4
        self.pieces: list[bytes] = []
        self.scores: list[float] = []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            self.pieces.append(data[off:off + n])
            self.scores.append(score)
            off += n
        self.piece_to_id = {p: i for i, p in enumerate(self.pieces)}
        self.bos_token_id, self.eos_token_id = 1, 2
        self.bos_token, self.eos_token = "<s>", "</s>"
        self.special_ids = frozenset({0, 1, 2})
        # `<0xHH>` byte-fallback pieces decode to the raw byte.
        self._bytes: list[bytes] = []
        for p in self.pieces:
            if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
                self._bytes.append(bytes([int(p[3:5], 16)]))
            else:
                self._bytes.append(p)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []         # (special tokens are never read from text here)
        if text:
            ids.append(self.piece_to_id[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.piece_to_id:
                ids.append(self.piece_to_id[b])
            else:
                ids.extend(byte + 3 for byte in b)
        while True:  # merge the best-scoring adjacent pair until none merges
            best, best_i = -1e30, -1
            for i in range(len(ids) - 1):
                j = self.piece_to_id.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
                if j is not None and self.scores[j] > best:
                    best, best_i, best_id = self.scores[j], i, j
            if best_i < 0:
                break
            ids[best_i:best_i + 2] = [best_id]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        prev = None
        for t in ids:
            if skip_special_tokens and t in self.special_ids:
                prev = t
                continue
            piece = self._bytes[t]
            if (prev == self.bos_token_id or prev is None) and piece.startswith(b" "):
                piece = piece[1:]  # run.c drops the space after BOS; HF strips the first space
            out += piece
            prev = t
        return out.decode("utf-8", errors="replace")
