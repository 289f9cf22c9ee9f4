"""Helpers for agent-loop tests: a scripted rollout client and dataset rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from postrl.rollout.types import SamplingParams, TokenOutput


@dataclass
class ScriptedClient:
    """A rollout client returning pre-set completions, one per generate call, in order.

    Each script entry is the completion text (special tokens allowed). A completion that ends
    with ``<|im_end|>`` finishes with "stop"; otherwise it is cut at ``max_new_tokens`` and
    finishes with "length" (what a real engine does). Every prompt received is recorded.
    """

    tokenizer: Any
    script: list[str]
    prompts: list[list[int]] = field(default_factory=list)
    generated: list[list[int]] = field(default_factory=list)
    samplings: list[SamplingParams] = field(default_factory=list)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        trajectory_id: str | None = None,
    ) -> TokenOutput:
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.samplings.append(sampling)
        text = self.script[min(k, len(self.script) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        reason = "stop" if ids and ids[-1] == self.tokenizer.eos_token_id else "length"
        if len(ids) > sampling.max_new_tokens:
            ids, reason = ids[: sampling.max_new_tokens], "length"
        self.generated.append(ids)
        # distinct, non-zero log-probs so tests can tell policy positions apart
        return TokenOutput(ids, [-0.01 * (i + 1) for i in range(len(ids))], reason)


def make_row(
    tokenizer,
    question: str = "What is 123*456?",
    request_id: str = "r0",
    system: str | None = "You can call tools.",
) -> dict[str, Any]:
    """A dataset row the way the manager passes it."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {
        "raw_prompt_ids": tokenizer.encode(text, add_special_tokens=False),
        "messages": messages,
        "data_source": "tool_arith",
        "ground_truth": "56088",
        "extra_info": {},
        "request_id": request_id,
        "uid": "0-0",
        "seed": 7,
        "sample_index": 0,
    }
