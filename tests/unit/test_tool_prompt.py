"""Tools and tool messages into prompts: SmolLM2's template ignores tools, so it gets the default rendering
(tools in the system message, calls as <tool_call> blocks, results as <tool_response> blocks); a template
that renders tools gets them, and the messages, natively."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from loraplex.checkpoints.sources import resolve_model
from loraplex.protocol.openai import ChatCompletionRequest
from loraplex.protocol.tools.prompt import default_rendering, writes_json_calls
from loraplex.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "second result"},
]
# A Hermes-like template that renders tools and tool calls itself.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments | tojson }}){% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return Tokenizer(AutoTokenizer.from_pretrained(resolve_model(None).path))


def template_messages(messages=CONVERSATION) -> list[dict]:
    return ChatCompletionRequest(messages=messages, tools=[WEATHER]).template_messages()


def test_messages_take_hugging_face_shape():
    user, assistant, tool, _ = template_messages()
    assert assistant == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert tool == {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "call_1"}


def test_default_rendering_puts_tools_calls_and_results_in_plain_messages():
    system, user, assistant, results = default_rendering(template_messages(), [WEATHER])
    assert system["role"] == "system" and json.dumps(WEATHER) in system["content"]
    assert "<tool_call>" in system["content"] and '"arguments": <args-json-object>' in system["content"]
    assert assistant == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert results == {"role": "user", "content": '<tool_response>\n{"temp_c": 21}\n</tool_response>\n'
                                                  "<tool_response>\nsecond result\n</tool_response>"}
    own_system = default_rendering([{"role": "system", "content": "Be brief."}, user], [WEATHER])
    assert own_system[0]["content"].startswith("Be brief.\n\n# Tools") and len(own_system) == 2
    assert default_rendering([user], None) == [user]  # no tools, no tool messages: unchanged


def test_smollm_template_gets_the_default_rendering(smollm):
    assert not smollm.renders_tools and not writes_json_calls(smollm.hf.chat_template)
    prompt = smollm.apply_chat_template(default_rendering(template_messages(), [WEATHER]))
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert prompt.startswith("<|im_start|>system\n# Tools") and prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_renders_tools_gets_them_natively(smollm):
    hf = AutoTokenizer.from_pretrained(resolve_model(None).path)
    hf.chat_template = TOOLS_TEMPLATE
    native = Tokenizer(hf)
    assert native.renders_tools
    prompt = native.apply_chat_template(template_messages(), tools=[WEATHER])
    assert prompt.startswith("<tools>") and '(call get_weather {"city": "Paris"})' in prompt
    assert '[tool]{"temp_c": 21}' in prompt


def test_llama_31_templates_are_known_for_json_calls():
    assert writes_json_calls("<|start_header_id|>ipython<|end_header_id|>{{ tools }}")
    assert not writes_json_calls("<|im_start|>{{ tools }}") and not writes_json_calls(None)
