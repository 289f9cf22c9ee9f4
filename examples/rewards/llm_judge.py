"""A generative reward model ("LLM as a judge") as a custom reward function.

The judge is any OpenAI-compatible chat endpoint — ``postrl serve --model DIR`` on 127.0.0.1, a
vLLM/SGLang server, or a hosted API. Use it with::

    reward:
      custom_function: {path: examples/rewards/llm_judge.py}
      timeout_s: 60
      reward_kwargs:
        judge_url: http://127.0.0.1:8000/v1
        judge_model: judge            # the server's model name
        # optional: judge_api_key_env (name of an env var holding the key), max_score (default 10)

Each sample becomes one chat request: the judge sees the question, the reference answer and the
response, and must reply with an integer score from 0 to ``max_score``; the reward is that score
divided by ``max_score``. A reply without a score returns None — the reward loop counts it as a
failed sample (``reward/failed/none``), never as 0. The request has its own deadline
(``judge_timeout_s``, default 30 s) inside ``reward.timeout_s``.
"""

from __future__ import annotations

import os
import re

import httpx

TEMPLATE = (
    "You grade answers. Question:\n{question}\n\nReference answer: {reference}\n\n"
    "Response:\n{response}\n\n"
    "Reply with one integer from 0 (wrong) to {max_score} (fully correct) and nothing else."
)


def compute_score(
    data_source,
    solution_str,
    ground_truth,
    extra_info=None,
    *,
    judge_url: str,
    judge_model: str = "judge",
    judge_api_key_env: str = "",
    max_score: int = 10,
    judge_timeout_s: float = 30.0,
    max_tokens: int = 8,
):
    """Score ``solution_str`` with the judge at ``judge_url``.

    Returns ``{"score": s / max_score, "judge_raw": s}``, or None when the judge's reply holds no
    integer in [0, max_score]."""
    question = (extra_info or {}).get("question") or (extra_info or {}).get("prompt") or ""
    prompt = TEMPLATE.format(
        question=question, reference=ground_truth, response=solution_str, max_score=max_score
    )
    headers = {}
    if judge_api_key_env:
        headers["Authorization"] = f"Bearer {os.environ[judge_api_key_env]}"
    r = httpx.post(
        f"{judge_url.rstrip('/')}/chat/completions",
        headers=headers,
        timeout=judge_timeout_s,
        json={
            "model": judge_model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        },
    )
    # an HTTP error is an exception: a failed sample with the status in its detail
    r.raise_for_status()
    text = r.json()["choices"][0]["message"]["content"]
    m = re.search(r"\d+", text)
    if m is None or not 0 <= int(m.group()) <= max_score:
        return None
    return {"score": int(m.group()) / max_score, "judge_raw": int(m.group())}
