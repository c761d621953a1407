"""Exactness of the grammar mask, on stories260K (SentencePiece-style BPE with byte fallback)
and on a random Llama with a byte-level BPE tokenizer. The reference is computed outside the
engine: llguidance's own matcher, built from the model's tokenizer.json with llguidance's API,
its bitmask applied to transformers' logits on the same weights, greedy argmax, stopping where
the matcher stops. kvserve's greedy output must equal it, token for token, and the mask kvserve
applies at every step must equal the reference matcher's. Every allowed set is also checked
against brute force over the vocabulary (a token is allowed only if the output's bytes with it
can still become a match: the `regex` module's partial matching, or a prefix of a choice; EOS
exactly when the match is complete). llguidance allows fewer tokens than brute force where
the grammar forces bytes: there it allows only their canonical tokenization (after "y" in
yes|no, "es" but not "e"). Seeded sampling never leaves the brute-force set either."""
from __future__ import annotations

from pathlib import Path

import llguidance as llg
import numpy as np
import pytest
import regex
import torch

from kvserve import LLM, SamplingParams
from kvserve.structured import StructuredOutputsParams as SO
from kvserve.structured.compiler import compile_matcher, ll_tokenizer
from kvserve.sample.grammar_mask import apply_grammar_bitmask, fill_rows_numpy, fill_rows_torch
from kvserve.structured.matcher import SequenceGrammar, grammar_bitmasks
from tests.reference.hf_reference import load_hf
from tests.structured.conftest import token_bytes

CASES = [dict(choice=["yes", "no"]), dict(regex=r"(Once|Lily|Tom) (was|had|saw) [a-z ]{2,12}\."),
         dict(regex=r'\{"age": [0-9]{1,2}\}')]
MAX_TOKENS = 24


def brute_force(spec: dict, text: bytes, tb: list) -> tuple[set[int], bool]:
    """(ids of the tokens allowed after `text`, whether `text` is a complete match)."""
    def ok(s: bytes) -> bool:
        try:
            u = s.decode("utf-8")
        except UnicodeDecodeError:          # the patterns here are ASCII: no partial characters
            return False
        if "choice" in spec:
            return any(c.startswith(u) for c in spec["choice"])
        return regex.fullmatch(spec["regex"], u, partial=True) is not None

    allowed = {i for i, b in enumerate(tb) if b and ok(text + b)}
    u = text.decode("utf-8")
    complete = u in spec["choice"] if "choice" in spec else regex.fullmatch(spec["regex"], u) is not None
    return allowed, complete


def allowed_by(matcher: llg.LLMatcher, V: int) -> set[int]:
    mask = matcher.compute_bitmask()
    return {i for i in range(V) if mask[i // 8] >> (i % 8) & 1}


@torch.inference_mode()
def reference(model_dir, spec: dict, prompt: list[int], eos: int, V: int):
    """transformers' greedy tokens under llguidance's own matcher, the finish reason, and the
    allowed set before each token (each checked against brute force)."""
    model, tb = load_hf(str(model_dir)), token_bytes(model_dir)
    ll = llg.LLTokenizer((Path(model_dir) / "tokenizer.json").read_text(), n_vocab=V, eos_token=eos)
    fmt, text, _ = SO(**spec).key
    m = llg.LLMatcher(ll, llg.grammar_from(fmt, text))
    ids, text, out, masks = list(prompt), b"", [], []
    for _ in range(MAX_TOKENS):
        if m.is_stopped():
            return out, "stop", masks                   # the grammar admits nothing more
        allowed = allowed_by(m, V)
        brute, complete = brute_force(spec, text, tb)
        assert allowed - {eos} <= brute and (eos in allowed) == complete and allowed, (spec, text)
        masks.append(allowed)
        logits = model(torch.tensor([ids])).logits[0, -1]
        t = max(allowed, key=lambda i: float(logits[i]))
        out.append(t)
        assert m.consume_token(t)
        if t == eos:
            return out, "stop", masks
        ids.append(t)
        text += tb[t]
    return out, "length", masks


def kvserve_masks(llm: LLM, spec: dict, tokens: list[int]) -> list[set[int]]:
    """The mask kvserve applies (compiled matcher -> bitmask -> -inf) before each token."""
    tok, V = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    ll = ll_tokenizer(tok, V)
    g = SequenceGrammar(compile_matcher(SO(**spec), ll), ll.vocab_size)
    masks = []
    for t in tokens:
        x = torch.zeros(1, V)
        bitmask, failed = grammar_bitmasks([g])               # the core's part
        assert not failed and not apply_grammar_bitmask(x, [0], bitmask)   # the sampler's
        masks.append(set(torch.isfinite(x[0]).nonzero().flatten().tolist()))
        assert g.accept(t)
    return masks


@pytest.mark.parametrize("spec", CASES, ids=["choice", "regex", "json-regex"])
@pytest.mark.parametrize("model", ["stories", "byte_level"])
def test_greedy_is_the_argmax_over_allowed_tokens(spec, model, stories_hf, byte_level_model):
    model_dir = stories_hf if model == "stories" else byte_level_model
    llm = LLM(str(model_dir), num_kv_blocks=64, max_num_seqs=4)
    tok = llm.engine.tokenizer
    prompts = [tok.encode("Once upon a time, Tom"), tok.encode('Lily said: {"age":')]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=SO(**spec))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    V = llm.engine.model_config.vocab_size
    for p, o in zip(prompts, outs):
        got = o.outputs[0]
        want, reason, masks = reference(model_dir, spec, p, tok.eos_token_id, V)
        assert (got.token_ids, got.finish_reason) == (want, reason), (model, spec)
        assert kvserve_masks(llm, spec, got.token_ids) == masks


@pytest.mark.parametrize("model", ["stories", "byte_level"])
def test_sampling_never_leaves_the_allowed_set(model, stories_hf, byte_level_model):
    model_dir = stories_hf if model == "stories" else byte_level_model
    llm = LLM(str(model_dir), num_kv_blocks=64, max_num_seqs=8)
    tok, tb = llm.engine.tokenizer, token_bytes(model_dir)
    for spec in CASES[1:]:
        params = SamplingParams(n=4, temperature=1.5, top_k=50, repetition_penalty=1.3, seed=7,
                                max_tokens=MAX_TOKENS, logprobs=3, structured_outputs=SO(**spec))
        out = llm.generate([{"prompt_token_ids": tok.encode("Once")}], params)[0]
        for c in out.outputs:
            text = b""
            for t, lp in zip(c.token_ids, c.logprobs):
                allowed, complete = brute_force(spec, text, tb)
                assert t in allowed or (complete and t == tok.eos_token_id), (spec, text, t)
                # logprobs are those of the masked distribution: only allowed tokens, summing to <= 1
                assert set(lp) - {t} <= allowed | {tok.eos_token_id}
                if t != tok.eos_token_id:
                    text += tb[t]
            if c.finish_reason == "stop":
                assert regex.fullmatch(spec["regex"], text.decode()), text


def test_the_device_mask_path_equals_the_cpu_one():
    """The grammar mask writes rows with numpy on the CPU and with torch elsewhere: the same rows."""
    rng = np.random.default_rng(0)
    forbidden = rng.random((3, 100)) < 0.7
    with torch.inference_mode():                  # as the runner's logits are
        a = torch.randn(5, 100)
    b = a.clone()
    fill_rows_numpy(a, [4, 0, 2], forbidden)
    fill_rows_torch(b, [4, 0, 2], forbidden)
    assert torch.equal(a, b) and torch.isinf(a[[4, 0, 2]]).sum() == forbidden.sum()
    assert torch.isfinite(a[[1, 3]]).all()
