"""A two-turn self-check agent on the official OpenAI client (knows nothing of postrl).

Turn 1 answers the task; turn 2 shows the model its own answer and asks it to check it and
give the final answer. Both replies are trained (the second extends the first: one segment);
the dataset's reward function scores the final message. With ``--report`` the agent scores
itself instead and POSTs ``{"reward": r}`` to ``POSTRL_REWARD_URL`` (here: whether both turns
give the same last number — a consistency reward, as an example of the contract only).
"""

import json
import os
import re
import sys
import urllib.request

from openai import OpenAI

CHECK = "Check your answer step by step. Reply with the final answer only."


def last_number(text: str) -> str | None:
    nums = re.findall(r"-?\d+", text or "")
    return nums[-1] if nums else None


def main() -> None:
    with open(os.environ["POSTRL_TASK"]) as f:
        task = json.load(f)
    client = OpenAI()
    messages = list(task["messages"])
    first = client.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": CHECK}]
    second = client.chat.completions.create(model="policy", messages=messages)
    final = second.choices[0].message.content or ""
    if "--report" in sys.argv:
        same = last_number(answer) is not None and last_number(answer) == last_number(final)
        req = urllib.request.Request(
            os.environ["POSTRL_REWARD_URL"],
            data=json.dumps({"reward": float(same)}).encode(),
            headers={"Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=30).read()


if __name__ == "__main__":
    main()
