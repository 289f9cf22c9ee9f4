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


def test_openai_routes(server):
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
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": "x"}).status_code == 422


def test_weight_buckets_over_http(tiny_model_factory):
    from safetensors.torch import load_file

    from postrl.weights import encode_frame, pack_buckets

    url, srv, be = _start(tiny_model_factory("qwen2"))
    try:
        d1 = tiny_model_factory("qwen2", seed=1)
        fresh = create_rollout_backend("native", d1, max_num_seqs=2, max_model_len=64)
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
