"""LLM: offline batched generation, vLLM's entry point (`LLM(model=...).generate(prompts, params)`)."""
from __future__ import annotations

from kvserve.frontend.chat_template import ChatRenderer
from kvserve.config import EngineConfig
from kvserve.frontend.llm_engine import LLMEngine
from kvserve.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from kvserve.sample.params import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = 0
        self._renderers: dict[str | None, ChatRenderer] = {}

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt is a
        string, {"prompt": str} or {"prompt_token_ids": [...]}; a dict may carry "cache_salt"
        (only requests with the same salt share prefix-cache blocks)."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts.")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._ids}"
                self._ids += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            self.engine.abort_request(ids)
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a list of
        them, each rendered with the model's chat template (or `chat_template`, a file or the
        template text; kvserve/frontend/chat_template.py: `continue_final_message` and the template's
        extra variables `chat_template_kwargs` too) and generated like `generate`. One
        RequestOutput per conversation, in input order."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                             "or a list of such lists (one per conversation).")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        renderer = self._chat_renderer(chat_template)
        prompts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise ValueError("each conversation must be a list of {'role', 'content'} dicts.")
            text = renderer.render(list(conv), add_generation_prompt, continue_final_message=continue_final_message,
                                   template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": renderer.encode(text)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_renderer(self, chat_template: str | None) -> ChatRenderer:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so chat is not available: use generate() "
                             "with prompt_token_ids.")
        if chat_template not in self._renderers:
            self._renderers[chat_template] = ChatRenderer(tokenizer, chat_template)
        return self._renderers[chat_template]

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's offline beam search: `LLM.beam_search(prompts, BeamSearchParams(beam_width,
        max_tokens, length_penalty=...))`. Returns, per prompt, all `beam_width` beams best
        first, each with the prompt's and its own tokens. Runs natively in the engine (beams
        are forked sequences sharing blocks; see kvserve/engine/beam_search.py)."""
        sp = params.to_sampling_params()
        outs = self.generate(prompts, sp)
        result = []
        for out in outs:
            seqs = [BeamSearchSequence(tokens=list(out.prompt_token_ids) + list(c.token_ids),
                                       output_token_ids=list(c.token_ids), cum_logprob=c.cumulative_logprob,
                                       text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                       logprobs=[e[t].logprob for e, t in zip(c.logprobs or [], c.token_ids)])
                    for c in out.outputs]
            result.append(BeamSearchOutput(seqs))
        return result
