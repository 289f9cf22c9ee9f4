"""The HTTP server answers real httpx clients on 127.0.0.1, rejects bad input, enforces keys."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from postrl.rollout import SamplingParams, create_rollout_backend
from postrl.rollout.server import check_bind
from postrl.testing.servers import start_server


def _start(model_dir, api_key=None):
    return start_server(model_dir, api_key)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    url, srv, be = _start(tiny_model_dir)
    yield url, be
    srv.should_exit = True


def test_generate_token_endpoint_matches_engine(server, tiny_model_dir):
    url, _ = server
    ref_be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=2, max_model_len=64)
    ref = asyncio.run(
        ref_be.generate(
            [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), "r"
        )
    )
    r = httpx.post(
        f"{url}/v1/generate",
        json={
            "prompt_ids": [1, 2, 3],
            "sampling": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (
        body["token_ids"] == ref.token_ids
        and len(body["log_probs"]) == 6
        and body["finish_reason"] == "length"
    )


def test_concurrent_clients(server):
    url, _ = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            rs = await asyncio.gather(
                *[
                    c.post(
                        "/v1/generate",
                        json={
                            "prompt_ids": [i + 1, 2],
                            "sampling": {
                                "temperature": 0,
                                "max_new_tokens": 3 + i,
                                "ignore_eos": True,
                            },
                        },
                    )
                    for i in range(12)
                ]
            )
        return rs

    rs = asyncio.run(run())
    assert all(r.status_code == 200 for r in rs)
    assert [len(r.json()["token_ids"]) for r in rs] == [3 + i for i in range(12)]


def test_openai_routes_over_plain_http(server):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "1+1=", "max_tokens": 5, "temperature": 0, "logprobs": 1},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert (
        isinstance(ch["text"], str)
        and len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"]) <= 5
    )
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "seed": 1},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 2 and body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 8
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["object"] == "model"


@pytest.mark.parametrize(
    "body,code",
    [
        ({}, 422),  # no prompt_ids
        ({"prompt_ids": []}, 422),
        ({"prompt_ids": "abc"}, 422),
        ({"prompt_ids": [1], "sampling": {"top_p": 0}}, 400),
        ({"prompt_ids": [1], "sampling": {"bogus": 1}}, 422),
        ({"prompt_ids": [10**9]}, 400),  # token id out of range
    ],
)
def test_malformed_bodies_get_4xx(server, body, code):
    url, _ = server
    r = httpx.post(f"{url}/v1/generate", json=body, timeout=30)
    assert r.status_code == code, r.text
    assert (
        httpx.post(
            f"{url}/v1/generate", content=b"not json", headers={"content-type": "application/json"}
        ).status_code
        == 422
    )
    # OpenAI routes answer bad parameters with 400 and an OpenAI error body
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": "x"}).status_code == 400


def test_weight_buckets_over_http(tiny_model_factory):
    from safetensors.torch import load_file

    from postrl.weights import encode_frame, pack_buckets

    url, srv, be = _start(tiny_model_factory("qwen2"))
    try:
        d1 = tiny_model_factory("qwen2", seed=1)
        fresh = create_rollout_backend("native", d1, max_num_seqs=2, max_model_len=64)
        top = {"prompt": "ab", "max_tokens": 4, "temperature": 0, "logprobs": 2}
        assert httpx.post(f"{url}/v1/completions", json=top, timeout=60).status_code == 200
        for b in pack_buckets(
            iter(load_file(str(d1 / "model.safetensors")).items()), bucket_bytes=1 << 20, version=5
        ):
            r = httpx.post(f"{url}/v1/weights/bucket", content=encode_frame(b), timeout=30)
            assert r.status_code == 200, r.text
        assert r.json()["policy_version"] == 5
        sp = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True, "seed": 4}
        got = httpx.post(
            f"{url}/v1/generate", json={"prompt_ids": [4, 5], "sampling": sp}, timeout=30
        ).json()
        ref = asyncio.run(fresh.generate([4, 5], SamplingParams(**sp), "x"))
        assert got["token_ids"] == ref.token_ids and got["versions"] == [[6, 5]]
        # top_logprobs follow the pushed weights: the best alternative is the greedy token
        lp = httpx.post(f"{url}/v1/completions", json=top, timeout=60).json()["choices"][0]
        lp = lp["logprobs"]
        for tok, tok_lp, alts in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert max(alts, key=alts.get) == tok and alts[tok] == pytest.approx(tok_lp, abs=1e-4)
        assert (
            httpx.post(
                f"{url}/v1/weights/bucket", content=b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}"
            ).status_code
            == 400
        )
    finally:
        srv.should_exit = True


def test_api_key_required_on_every_route(tiny_model_dir):
    url, srv, _ = _start(tiny_model_dir, api_key="s3cret")
    try:
        for method, path, kw in [
            ("GET", "/health", {}),
            ("GET", "/v1/models", {}),
            ("POST", "/v1/generate", {"json": {"prompt_ids": [1]}}),
            ("POST", "/v1/weights/bucket", {"content": b"x"}),
            ("POST", "/v1/sleep", {}),
            (
                "POST",
                "/v1/chat/completions",
                {"json": {"messages": [{"role": "user", "content": "a"}]}},
            ),
        ]:
            assert httpx.request(method, url + path, **kw).status_code == 401
            bad = httpx.request(method, url + path, headers={"Authorization": "Bearer nope"}, **kw)
            assert bad.status_code == 401
        ok = httpx.post(
            f"{url}/v1/generate",
            json={"prompt_ids": [1], "sampling": {"max_new_tokens": 2}},
            headers={"Authorization": "Bearer s3cret"},
            timeout=30,
        )
        assert ok.status_code == 200
    finally:
        srv.should_exit = True


def test_non_loopback_bind_needs_key():
    with pytest.raises(SystemExit, match="API key"):
        check_bind("0.0.0.0", None)
    with pytest.raises(SystemExit):
        check_bind("192.168.1.5", "")
    check_bind("0.0.0.0", "k")
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)


# ---------------------------------------------------------------- the official openai client
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def oai(server):
    url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)


def test_openai_client_completions_logprobs_name_tokens_and_top_logprobs(oai):
    r = oai.completions.create(model="tiny", prompt="1+1=", max_tokens=6, temperature=0, logprobs=3)
    ch = r.choices[0]
    lp = ch.logprobs
    n = r.usage.completion_tokens
    assert isinstance(ch.text, str) and len(lp.tokens) == len(lp.token_logprobs) == n >= 1
    assert all(isinstance(t, str) for t in lp.tokens) and "".join(lp.tokens).startswith(ch.text)
    assert lp.text_offset[0] == 0 and len(lp.top_logprobs) == n
    for tok, tok_lp, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(alts) <= 3 and all(v <= 0 for v in alts.values())
        # greedy: the chosen token is the most likely one, and the scoring copy agrees with
        # the engine's own log-prob of it
        best = max(alts, key=alts.get)
        assert best == tok and alts[best] == pytest.approx(tok_lp, abs=1e-4)


def test_openai_client_chat_logprobs_and_top_logprobs(oai):
    r = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_openai_client_n_seed_and_stop(oai):
    msgs = [{"role": "user", "content": "tell me"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=1.0, n=3)
    a = oai.chat.completions.create(seed=11, **kw)
    b = oai.chat.completions.create(seed=11, **kw)
    texts = [c.message.content for c in a.choices]
    assert len(texts) == 3 and texts == [c.message.content for c in b.choices]  # same seed
    assert len(set(texts)) > 1  # choice i samples with seed + i
    # stop: the text ends before the first occurrence of the stop string, which is cut
    greedy = oai.completions.create(model="tiny", prompt="ab", max_tokens=16, temperature=0)
    full = greedy.choices[0].text
    stop = full[4:6]
    assert len(stop) == 2, full
    cut = oai.completions.create(
        model="tiny", prompt="ab", max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_openai_client_streaming_returns_chunks_and_usage(oai):
    kw = dict(model="tiny", max_tokens=8, temperature=0)
    msgs = [{"role": "user", "content": "count"}]
    whole = oai.chat.completions.create(messages=msgs, **kw)
    chunks = list(
        oai.chat.completions.create(
            messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    assert len(chunks) > 3 and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # completions stream, with per-token logprobs
    plain = oai.completions.create(prompt="xy", logprobs=0, **kw)
    parts = list(oai.completions.create(prompt="xy", stream=True, logprobs=0, **kw))
    assert "".join(p.choices[0].text for p in parts) == plain.choices[0].text
    streamed = [p.choices[0].logprobs.token_logprobs[0] for p in parts if p.choices[0].logprobs]
    assert streamed == pytest.approx(plain.choices[0].logprobs.token_logprobs)


def test_openai_client_errors_have_openais_shape(oai, server):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model="tiny", messages=[{"role": "wizard", "content": "x"}], max_tokens=2
        )
    assert e.value.status_code == 400 and e.value.type == "invalid_request_error"
    assert "role" in e.value.message
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            top_logprobs=50,
        )
    url, _ = server
    body = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}).json()
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_openai_client_wrong_key_is_authentication_error(tiny_model_dir):
    url, srv, _ = _start(tiny_model_dir, api_key="k1")
    try:
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.code == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0)
        assert [m.id for m in good.models.list()]
    finally:
        srv.should_exit = True


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
# ChatML with Qwen's tools block: the tool schemas are rendered into the system turn
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}"
    "{{- t | tojson }}{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
REPLY = 'Let me add.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


class _ScriptedBackend:
    """Replies with a fixed text (the HTTP layer's tool-call path needs a known reply)."""

    def __init__(self, tokenizer):
        self.ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids, sampling, request_id):
        from postrl.rollout import TokenOutput

        self.prompts.append(list(prompt_ids))
        return TokenOutput(list(self.ids), [-0.5] * len(self.ids), "stop", None)


def test_openai_client_tools_rendered_and_tool_calls_parsed(tiny_model_dir, tmp_path):
    import json
    import shutil
    import socket
    import threading
    import time

    import uvicorn
    from transformers import AutoTokenizer

    from postrl.rollout import RolloutReplica
    from postrl.rollout.server import create_app
    from postrl.tools.parsers import get_tool_parser

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOLS_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    tok = AutoTokenizer.from_pretrained(str(model))
    be = _ScriptedBackend(tok)
    app = create_app(RolloutReplica(be), tok, tool_parser=get_tool_parser("hermes"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        c = openai.OpenAI(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", max_retries=0
        )
        msgs = [{"role": "user", "content": "2+3?"}]
        r = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, max_tokens=64)
        # the tool schema went through the model's chat template into the prompt
        assert '"name": "add"' in tok.decode(be.prompts[-1])
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me add."
        call = msg.tool_calls[0]
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
        # the call and its result go back in, as OpenAI clients send them
        follow = [
            *msgs,
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        c.chat.completions.create(model="m", messages=follow, tools=TOOLS, max_tokens=64)
        assert "<|im_start|>tool\n5" in tok.decode(be.prompts[-1])
        # streaming delivers the call as a delta
        chunks = list(c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True))
        deltas = [ch.choices[0].delta.tool_calls for ch in chunks if ch.choices[0].delta.tool_calls]
        assert deltas[0][0].function.name == "add"
        # tool_choice="none": the reply is plain text
        plain = c.chat.completions.create(model="m", messages=msgs, tools=TOOLS, tool_choice="none")
        assert (
            plain.choices[0].message.tool_calls is None
            and "<tool_call>" in plain.choices[0].message.content
        )
        assert len(r.choices[0].message.tool_calls) == 1
    finally:
        srv.should_exit = True
