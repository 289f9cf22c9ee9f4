"""Agents for the gateway tests: real programs on the official ``openai`` client.

As a script (``python gw_agents.py MODE``) it is what ``rollout.agent.gateway.command`` runs;
its async functions are ``rollout.agent.gateway.entrypoint`` targets (``gw_agents:NAME``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def _task(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


async def tool_agent(base_url, api_key, task, task_path, reward_url, stream=False):
    """Calls the model with the calculator tool, executes each call itself, sends the result
    back; returns the final text (no reward: the dataset's function scores it)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(task["messages"])
    for _ in range(4):
        r = await client.chat.completions.create(
            model="anything", messages=messages, tools=[CALC], logprobs=True
        )
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return None
        for c in msg.tool_calls:
            expr = json.loads(c.function.arguments)["expression"]
            value = str(eval(expr, {"__builtins__": {}}))  # test-only: a trusted expression
            messages.append({"role": "tool", "tool_call_id": c.id, "content": value})
    return None


async def rewrite_agent(base_url, api_key, task, task_path, reward_url):
    """Two conversations: asks, then asks again with its history rewritten (a summary); returns
    a reward of 0.5."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = await client.chat.completions.create(model="m", messages=task["messages"])
    summary = [
        {"role": "user", "content": "Earlier you said: " + (first.choices[0].message.content or "")}
    ]
    await client.chat.completions.create(model="m", messages=summary)
    return {"reward": 0.5}


def _chat(messages: list) -> str:
    """One chat completion over plain urllib (modes that need no ``openai`` import: fast)."""
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "x", "messages": messages}).encode(),
        headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["message"]["content"]


def main(mode: str) -> int:
    if mode == "e2e":
        return e2e_main()
    task = _task(os.environ["POSTRL_TASK"])
    if mode == "crash":
        raise RuntimeError("the agent crashed")
    if mode == "hang":
        time.sleep(3600)
    if mode == "garbage":
        url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
        req = urllib.request.Request(
            url,
            data=b"{not json",
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
        )
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as e:
            print("status", e.code)
        return 0
    if mode == "stream":
        from openai import OpenAI

        client = OpenAI(max_retries=0)
        chunks = client.chat.completions.create(
            model="x", messages=task["messages"], stream=True, logprobs=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        print(json.dumps({"streamed": text}))
        return 0
    text = _chat(task["messages"])
    if mode == "exit3":
        return 3
    if mode == "reward_url":
        req = urllib.request.Request(
            os.environ["POSTRL_REWARD_URL"], data=json.dumps({"reward": 0.25}).encode()
        )
        urllib.request.urlopen(req, timeout=30).read()
    if mode == "reward_stdout":
        print("some log line")
        print(json.dumps({"reward": 0.75}))
    if mode == "echo":
        print(json.dumps({"text": text}))
    return 0


PROBES: dict[str, int] = {}


async def probe_agent(base_url, api_key, task, task_path, reward_url):
    """Sends refused requests (recording the status codes in ``PROBES``), then one good one."""
    import httpx

    good = {"model": "m", "messages": task["messages"]}
    auth = {"Authorization": f"Bearer {api_key}"}
    root = base_url.rsplit("/s/", 1)[0]
    async with httpx.AsyncClient(timeout=30) as h:
        for name, url, body, headers in (
            ("unknown_key", base_url, {**good, "frobnicate": 1}, auth),
            ("n2", base_url, {**good, "n": 2}, auth),
            ("wrong_key", base_url, good, {"Authorization": "Bearer sk-wrong"}),
            ("no_key_root", root + "/v1", good, {}),
            ("bad_reward", base_url.replace("/v1", "/reward"), {"reward": "high"}, {}),
        ):
            r = await h.post(
                url.rstrip("/") + ("" if "reward" in url else "/chat/completions"),
                json=body,
                headers=headers,
            )
            PROBES[name] = r.status_code
            PROBES[name + "_msg"] = r.json()["error"]["message"]
        r = await h.post(root + "/v1/chat/completions", json=good, headers=auth)  # by key
        PROBES["by_key"] = r.status_code
    return None


async def e2e_agent(base_url, api_key, task, task_path, reward_url):
    """Two turns (the second extends the first); rows with an odd index then rewrite the
    history (a second segment). The reward: the final text's character codes mod 97, / 96."""
    import httpx

    auth = {"Authorization": f"Bearer {api_key}"}
    url = base_url + "/chat/completions"
    async with httpx.AsyncClient(timeout=120) as h:

        async def chat(messages):
            r = await h.post(url, json={"model": "m", "messages": messages}, headers=auth)
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        messages = list(task["messages"])
        first = await chat(messages)
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Sure?"}]
        final = await chat(messages)
        if int(task["index"]) % 2:
            final = await chat([{"role": "user", "content": "Summary: " + final[:20]}])
    return {"reward": (sum(map(ord, final)) % 97) / 96}


def e2e_main() -> int:
    """``e2e_agent`` as a command (the environment carries the four variables)."""
    import asyncio

    env = os.environ
    out = asyncio.run(
        e2e_agent(
            env["OPENAI_BASE_URL"],
            env["OPENAI_API_KEY"],
            _task(env["POSTRL_TASK"]),
            env["POSTRL_TASK"],
            env["POSTRL_REWARD_URL"],
        )
    )
    print(json.dumps(out))
    return 0


RUNNING = {"now": 0, "max": 0}


async def busy_agent(base_url, api_key, task, task_path, reward_url):
    """Counts agents running at once (``RUNNING``); asks nothing."""
    import asyncio

    RUNNING["now"] += 1
    RUNNING["max"] = max(RUNNING["max"], RUNNING["now"])
    await asyncio.sleep(0.05)
    RUNNING["now"] -= 1
    return 1.0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
