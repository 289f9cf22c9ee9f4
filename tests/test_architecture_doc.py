"""docs/architecture.md matches the code: the step table lists ``RLTrainer.step``'s calls in
the order the step makes them, every module it names exists, the layer table is the layer rule
of ``tests/test_layers.py``, and the step stays short."""

from __future__ import annotations

import importlib.util
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


_LAYERS = (
    r"(?:trainer|reward|rollout|agent|engine|workers|weights|controller|data|config|tools|"
    r"protocol|supervised|algos|envs|tracking|kernels)"
)


def test_every_module_the_doc_names_exists():
    """Every ``layer/…/module.py`` and ``layer/…/`` folder the page names — in backticks or in
    the trajectory's diagram — exists (a move that forgets the page fails here)."""
    mods = set(re.findall(rf"(?<![\w/.])({_LAYERS}/[a-z_/]+\.py)\b", DOC))
    assert len(mods) > 20, mods
    missing = sorted(m for m in mods if not (ROOT / "postrl" / m).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    folders = set(re.findall(rf"(?<![\w/.])({_LAYERS}/[a-z_]+/)", DOC))
    assert not sorted(f for f in folders if not (ROOT / "postrl" / f).is_dir()), folders


def _layer_rule() -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("_layers", ROOT / "tests" / "test_layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.MAY_IMPORT


def test_layer_table_is_the_layer_rule():
    """The page's layer table has one row per layer of ``tests/test_layers.py``'s rule, and each
    row's "may import" column is that layer's row (``trainer``: "everything above")."""
    section = DOC.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 5 or not cells[1].startswith("`"):
            continue
        name = cells[1].strip("`").rstrip("/").removesuffix(".py")
        col = cells[3]
        rows[name] = set() if col == "—" else {c.strip() for c in col.split(",")}
    rule = _layer_rule()
    assert set(rows) == set(rule) - {"__init__"}, set(rows) ^ (set(rule) - {"__init__"})
    for name, deps in rows.items():
        if deps == {"everything above"}:
            continue
        assert deps == rule[name], (name, deps, rule[name])
