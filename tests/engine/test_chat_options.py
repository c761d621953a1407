"""`LLM.chat`'s rendering options, as vLLM's: `continue_final_message` and `chat_template_kwargs`."""
from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.server.live import STORIES_HF

GREEDY = SamplingParams(temperature=0, max_tokens=8)
HISTORY = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(STORIES_HF))


def test_continue_final_message_goes_on_writing_the_last_message(llm):
    out = llm.chat(HISTORY, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    # The fallback template writes "User: ...\nAssistant: Once upon\n": cut after the message.
    ref = llm.generate(["User: Tell a story\nAssistant: Once upon"], GREEDY)[0]
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(HISTORY, GREEDY, continue_final_message=True)


def test_template_kwargs_reach_the_template_or_are_refused(llm):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if loud %}!{% endif %}"
    quiet = llm.chat(HISTORY[:1], GREEDY, chat_template=template, chat_template_kwargs={"loud": False})[0]
    loud = llm.chat(HISTORY[:1], GREEDY, chat_template=template, chat_template_kwargs={"loud": True})[0]
    assert (quiet.prompt, loud.prompt) == ("Tell a story\n", "Tell a story\n!")
    with pytest.raises(ValueError, match="not read by this model's chat template"):
        llm.chat(HISTORY[:1], GREEDY, chat_template=template, chat_template_kwargs={"enable_thinking": True})
    with pytest.raises(ValueError, match="may not set"):
        llm.chat(HISTORY[:1], GREEDY, chat_template=template, chat_template_kwargs={"messages": []})
