"""The real trained model: the llama2.c checkpoint and its HF copy give transformers' greedy
tokens, and the text reads as a children's story."""
from __future__ import annotations

from kvserve import LLM, SamplingParams
from tests.conftest import STORIES_C, STORIES_HF
from tests.reference.hf_reference import hf_greedy

PROMPTS = ["Once upon a time", "Tom had a red ball. He", "The cat sat on the"]


def test_hf_and_llama2c_match_transformers():
    n = 40
    hf = LLM(str(STORIES_HF))
    c = LLM(str(STORIES_C))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    hf_outs = hf.generate(PROMPTS, params)
    c_outs = c.generate(PROMPTS, params)
    for prompt, a, b in zip(PROMPTS, hf_outs, c_outs):
        assert a.prompt_token_ids == b.prompt_token_ids  # llama2.c's encode == tokenizer.json
        ref, ref_lp = hf_greedy(str(STORIES_HF), a.prompt_token_ids, n)
        assert a.outputs[0].token_ids == ref
        assert b.outputs[0].token_ids == ref
        assert a.outputs[0].text == b.outputs[0].text
        for lp, t, r in zip(b.outputs[0].logprobs, ref, ref_lp):
            assert abs(lp[t].logprob - r) < 1e-4


def test_reads_as_a_story():
    llm = LLM(str(STORIES_C))
    out = llm.generate([{"prompt_token_ids": [1]}], SamplingParams(temperature=0.0, max_tokens=60))
    text = out[0].outputs[0].text
    # llama2.c's test_all.py expected output for stories260K from BOS.
    assert text.startswith("Once upon a time, there was a little girl named Lily. "
                           "She loved to play outside in the park.")
