"""A single-turn verifiers environment built by hand (verifiers 0.4, ``verifiers.v1``): the
model is asked for a digit and scores 1 when its reply contains it, plus a small bonus for a
short reply (so a random tiny model's group rewards differ and GRPO has a signal). Runs in the
verifiers venv (``make verifiers-venv``); postrl's ``verifiers`` loop trains on it unchanged."""

import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str


class EchoTask(vf.Task[EchoData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(self.data.answer in trace.last_reply)

    @vf.reward(weight=0.1)
    async def brief(self, trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self):
        for i in range(8):
            yield EchoTask(EchoData(prompt=f"Say {i}.", answer=str(i)), self.config.task)


__all__ = ["EchoTaskset"]
