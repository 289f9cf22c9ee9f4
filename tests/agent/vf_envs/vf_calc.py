"""A tool-using verifiers environment built by hand: an MCP tool server (``vf.Toolset``, one
``add`` tool, started per rollout by verifiers in a subprocess) and a reward for the sum in the
final reply. ``python -m vf_calc`` is how verifiers starts the tool server."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # advertise the tool as plain `add`

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddData(vf.TaskData):
    a: int
    b: int


class AddTask(vf.Task[AddData]):
    @classmethod
    def toolsets(cls, config):
        return [CalcToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, trace) -> float:
        return float(str(self.data.a + self.data.b) in trace.last_reply)


class AddTaskset(vf.Taskset[AddTask]):
    def load(self):
        for a, b in [(3, 4), (12, 30), (5, 5)]:
            prompt = f"What is {a} + {b}? Use the add tool."
            yield AddTask(AddData(prompt=prompt, a=a, b=b), self.config.task)


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    CalcToolset.run()
