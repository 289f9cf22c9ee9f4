"""docs/architecture.md matches the code: the step table lists ``RLTrainer.step``'s calls in
the order the step makes them, every module it names exists, and the step stays short."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from postrl.trainer.trainer import RLTrainer

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _step_table_calls() -> list[str]:
    section = DOC.split("## One step, as the code runs it", 1)[1].split("\n## ", 1)[0]
    calls = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and re.fullmatch(r"\d|–", cells[1]):
            calls += [c.split("(")[0] for c in re.findall(r"`([^`]+)`", cells[2])]
    return calls


def test_step_table_is_the_step_in_order():
    src = inspect.getsource(RLTrainer.step)
    calls = _step_table_calls()
    assert len(calls) >= 11, calls
    pos = 0
    for call in calls:
        name = call.split(".")[-1]
        at = src.find(name, pos)
        assert at >= 0, f"{call!r} (docs/architecture.md) is not called by step() after pos {pos}"
        pos = at
    assert len(src.splitlines()) <= 50  # the bound on step()


def test_every_module_the_doc_names_exists():
    for mod in set(
        re.findall(
            r"`((?:trainer|reward|rollout|agent|engine|workers|weights|"
            r"controller|data|config|tools)/(?:[a-z_]+/)*(?:[a-z_]+\.py)?)`",
            DOC,
        )
    ):
        assert (ROOT / "postrl" / mod).exists(), mod  # a module, or a folder (``trainer/x/``)
