"""vLLM's token-in route (``POST /inference/v1/generate``) on a real ``postrl serve`` app over
HTTP on 127.0.0.1: the shapes a vLLM client (verifiers' training client) reads, the engine's
own tokens and log-probs, extra keys ignored but listed and counted, unsupported ones refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from postrl.rollout import SamplingParams, create_rollout_backend
from postrl.rollout.token_route import IGNORED_HEADER
from postrl.testing.servers import start_server

ROUTE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    url, srv, be = start_server(tiny_model_dir, max_model_len=256)
    yield url
    srv.should_exit = True


def _post(url, body):
    return httpx.post(f"{url}{ROUTE}", json=body, timeout=60)


def test_greedy_tokens_and_logprobs_match_the_engine(server, tiny_model_dir):
    ref_be = create_rollout_backend("native", tiny_model_dir, max_num_seqs=2, max_model_len=64)
    try:
        ref = asyncio.run(
            ref_be.generate(
                [5, 6, 7], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True), "r"
            )
        )
    finally:
        ref_be.close()
    r = _post(
        server,
        {
            "model": "whatever",
            "token_ids": [5, 6, 7],
            "sampling_params": {
                "temperature": 0,
                "max_tokens": 6,
                "ignore_eos": True,
                "logprobs": 1,
                "skip_special_tokens": False,
                "stop_token_ids": [258],
            },
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["token_ids"] == ref.token_ids and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    # what verifiers' client checks: one entry per token, "token_id:N", a finite log-prob
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ref.token_ids]
    assert [e["logprob"] for e in content] == pytest.approx(ref.log_probs, abs=1e-4)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert body["prompt_logprobs"] is None and isinstance(body["request_id"], str)
    # skip_special_tokens only shapes text, which this route does not return: listed as ignored
    assert "sampling_params.skip_special_tokens" in r.headers[IGNORED_HEADER]


def test_extra_keys_are_ignored_listed_and_counted(server):
    extra = {"detokenize": False, "flat_logprobs": True, "extra_args": {"x": 1}, "zz_new": 3}
    body = {
        "token_ids": [1, 2],
        "cache_salt": "abc",
        "sampling_params": {"max_tokens": 2, "ignore_eos": True, **extra, "min_p": 0.0},
    }
    before = httpx.get(f"{server}/inference/v1/ignored_keys").json()["ignored_keys"]
    for _ in range(2):
        r = _post(server, body)
        assert r.status_code == 200, r.text
        listed = r.headers[IGNORED_HEADER].split(",")
        assert sorted(listed) == sorted(["cache_salt", *(f"sampling_params.{k}" for k in extra)])
        assert r.json()["choices"][0]["logprobs"] is None  # logprobs not asked for
    after = httpx.get(f"{server}/inference/v1/ignored_keys").json()["ignored_keys"]
    for key in listed:
        assert after[key] - before.get(key, 0) == 2
    # a request with only honoured keys carries no header
    r = _post(server, {"token_ids": [1], "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 200 and IGNORED_HEADER not in r.headers


@pytest.mark.parametrize(
    "body, field",
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
        ({"token_ids": [1], "sampling_params": {"min_tokens": 4}}, "min_tokens"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": -1}}, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"token_ids": [1], "stream": True}, "stream"),
        ({"token_ids": [1], "features": {"mm_hashes": []}}, "features"),
    ],
)
def test_bad_requests_name_the_field(server, body, field):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_n_seeds_and_top_logprobs(server):
    sp = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True}
    a = _post(server, {"token_ids": [3, 4], "sampling_params": {**sp, "logprobs": 0}}).json()
    b = _post(server, {"token_ids": [3, 4], "sampling_params": {**sp, "logprobs": 0}}).json()
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    # choice 1 samples with seed 12: the same as a single request with seed 12
    one = _post(server, {"token_ids": [3, 4], "sampling_params": {**sp, "n": 1, "seed": 12}}).json()
    assert one["choices"][0]["token_ids"] == a["choices"][1]["token_ids"]
    r = _post(server, {"token_ids": [3, 4], "sampling_params": {**sp, "n": 1, "logprobs": 3}})
    assert r.status_code == 200, r.text
    for e in r.json()["choices"][0]["logprobs"]["content"]:
        tops = e["top_logprobs"]
        assert len(tops) == 3 and all(t["token"].startswith("token_id:") for t in tops)
        assert tops[0]["logprob"] >= tops[1]["logprob"] >= tops[2]["logprob"]
        assert tops[0]["logprob"] >= e["logprob"] - 1e-4  # the top one is the most likely


def test_models_lists_max_model_len(server):
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["max_model_len"] == 256


VERIFIERS_PY = Path(__file__).resolve().parents[2] / ".venv-verifiers" / "bin" / "python"
_RENDERER_CLIENT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate
from renderers.configs import DefaultRendererConfig

url, model_dir, model = sys.argv[1:4]


async def main():
    config = DefaultRendererConfig(tool_parser="qwen3")
    renderer = create_renderer(load_tokenizer(model_dir), config)
    client = AsyncOpenAI(base_url=url + "/v1", api_key="x")
    sp = {"max_tokens": 6, "temperature": 1.0, "seed": 5}
    a = await generate(client=client, renderer=renderer, model=model, sampling_params=sp,
                       messages=[{"role": "user", "content": "2+3?"}])
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    tools = [{"name": "add", "description": "add", "parameters": {"type": "object"}}]
    msgs = [{"role": "user", "content": "2+3?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    b = await generate(client=client, renderer=renderer, model=model, sampling_params=sp,
                       messages=msgs, tools=tools)
    await client.close()
    keys = ("prompt_ids", "completion_ids", "completion_logprobs", "finish_reason")
    print(json.dumps([{k: r[k] for k in keys} for r in (a, b)]))


asyncio.run(main())
"""


@pytest.mark.skipif(not VERIFIERS_PY.exists(), reason="no .venv-verifiers (docs/agent.md)")
def test_verifiers_renderer_client_against_the_server(server, tiny_model_dir, tmp_path):
    """verifiers 0.4.0's token-in client (``renderers.client.generate``, what its
    ``TrainClient`` calls), in its own venv, renders with our tokenizer's chat template, posts
    to the route and accepts the answer; the tools + tool_calls conversation renders too."""
    import json
    import subprocess

    model = httpx.get(f"{server}/v1/models").json()["data"][0]["id"]
    script = tmp_path / "client.py"
    script.write_text(_RENDERER_CLIENT)
    proc = subprocess.run(
        [str(VERIFIERS_PY), str(script), server, str(tiny_model_dir), model],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, tools = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in (plain, tools):
        assert 1 <= len(r["completion_ids"]) == len(r["completion_logprobs"]) <= 6
        assert all(lp < 0 for lp in r["completion_logprobs"])
    # the same seed and prompt through /inference/v1/generate directly: the same tokens
    direct = _post(
        server,
        {
            "token_ids": plain["prompt_ids"],
            "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 5},
        },
    ).json()
    n = len(plain["completion_ids"])  # the renderer's stop ids may end it earlier
    assert direct["choices"][0]["token_ids"][:n] == plain["completion_ids"]
    assert len(tools["prompt_ids"]) > len(plain["prompt_ids"]) + 20  # schemas + call rendered
