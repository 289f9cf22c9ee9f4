"""The make-model chat template: the plain ChatML rendering of before, byte for byte, plus
``tools`` (a system block) and assistant messages carrying ``tool_calls`` with no content."""

from __future__ import annotations

import json

import pytest

from postrl.testing import make_tokenizer

# the template before tools/tool_calls were rendered (postrl <= issue 35), kept as the oracle
OLD_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "2+3?"}],
    [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "assistant", "content": "The answer is 5."},
    ],
    [{"role": "tool", "content": "7"}, {"role": "assistant", "content": ""}],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.mark.parametrize("conv", CONVERSATIONS)
@pytest.mark.parametrize("gen", [False, True])
def test_existing_rendering_is_unchanged(tok, conv, gen):
    new = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    old = tok.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=gen, chat_template=OLD_TEMPLATE
    )
    assert new == old
    # tools=None or [] is the same as no tools
    assert tok.apply_chat_template(conv, tools=[], tokenize=False, add_generation_prompt=gen) == new


@pytest.mark.parametrize("arguments", [{"expression": "2+3"}, '{"expression": "2+3"}'])
def test_tool_calls_without_content_render_as_the_sampled_call(tok, arguments):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "calculator", "arguments": arguments},
    }
    conv = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    # exactly what a demonstration whose content is the call text renders (the hermes format)
    as_text = [conv[0], {"role": "assistant", "content": CALL}, conv[2]]
    assert text == tok.apply_chat_template(as_text, tokenize=False, add_generation_prompt=True)
    # content before the calls, two calls separated by a newline
    two = {"role": "assistant", "content": "Let me add.", "tool_calls": [call, call]}
    text = tok.apply_chat_template([conv[0], two], tokenize=False)
    assert text.endswith(f"<|im_start|>assistant\nLet me add.\n{CALL}\n{CALL}<|im_end|>\n")


def test_tools_open_a_system_turn(tok):
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "2+3?"}]
    text = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    schema = json.dumps(TOOLS[0])
    assert text == (
        f"<|im_start|>system\nS\n\n<tools>\n{schema}\n</tools><|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(conv[1:], tools=TOOLS, tokenize=False)
    assert text.startswith(f"<|im_start|>system\n<tools>\n{schema}\n</tools><|im_end|>\n")
