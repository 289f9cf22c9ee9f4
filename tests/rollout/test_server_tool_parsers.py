"""``postrl serve`` with a non-hermes tool parser answers the real ``openai`` client with
``tool_calls``: qwen3_coder (values typed by the request's ``tools``) and gpt-oss (harmony
markers are special tokens: the server parses the reply decoded with them, and returns
neither the analysis channel nor the markers as content)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import openai
import pytest

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "integer"},
                    "note": {"type": "string"},
                },
                "required": ["a", "b"],
            },
        },
    }
]
# ChatML with the tool schemas in the system turn
TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}"
    "{{- t | tojson }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# replies in each family's documented format (see tests/tools/test_parsers.py for sources)
QWEN3_CODER_REPLY = (
    "Let me add.\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n"
    "<parameter=b>\n3\n</parameter>\n<parameter=note>\n7\n</parameter>\n</function>\n</tool_call>"
)
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"]
GPT_OSS_REPLY = (
    "<|channel|>analysis<|message|>Use the add tool.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3, "note": "7"}'
    "<|call|>"
)

KIMI = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
KIMI_REPLY = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
    '{"a": 2, "b": 3, "note": "7"}<|tool_call_end|><|tool_calls_section_end|>'
)


class _ScriptedBackend:
    """Replies with fixed token ids (the HTTP layer's tool path needs a known reply)."""

    def __init__(self, ids):
        self.ids = list(ids)

    async def generate(self, prompt_ids, sampling, request_id):
        from postrl.rollout import TokenOutput

        return TokenOutput(list(self.ids), [-0.5] * len(self.ids), "stop", None)


def _serve(app):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started, "uvicorn did not start within 30 s"
    return srv, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


@pytest.mark.parametrize(
    "parser, reply, special, content, call_id",
    [
        ("qwen3_coder", QWEN3_CODER_REPLY, [], "Let me add.", "call_"),
        ("gpt-oss", GPT_OSS_REPLY, HARMONY, None, "call_"),
        # Kimi's template writes call ids back into the prompt: the model's own id is returned
        ("kimi_k2", KIMI_REPLY, KIMI, None, "functions.add:0"),
    ],
)
def test_openai_client_gets_tool_calls_of_the_configured_parser(
    tiny_model_dir, tmp_path, parser, reply, special, content, call_id
):
    from transformers import AutoTokenizer

    from postrl.rollout import RolloutReplica
    from postrl.rollout.server import create_app
    from postrl.tools.parsers import get_tool_parser

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(str(model))
    if special:  # the family's markers as special tokens, as in its real tokenizer
        tok.add_special_tokens({"additional_special_tokens": special})
    ids = tok.encode(reply, add_special_tokens=False)
    if special:  # a decode that skips special tokens loses the markers
        assert special[0] not in tok.decode(ids, skip_special_tokens=True)
    app = create_app(
        RolloutReplica(_ScriptedBackend(ids)), tok, tool_parser=get_tool_parser(parser)
    )
    srv, url = _serve(app)
    try:
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "2+3?"}]
        r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == content
        assert len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.type == "function" and call.function.name == "add"
        assert call.id.startswith(call_id)
        # "note" is a string in the request's schema: "7" stays text, a and b are integers
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3, "note": "7"}
        chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True))
        deltas = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert deltas[0][0].function.name == "add"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert streamed == (content or "")
    finally:
        srv.should_exit = True
