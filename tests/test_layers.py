"""The layer rule of DESIGN.md: each package imports only the layers its row allows.

Every ``import postrl.X`` / ``from postrl.X import ...`` in a module (top level or inside a
function: a lazy import is still a dependency) is checked against DESIGN.md's "may import"
column, closed transitively (``workers`` may import ``engine``, so it may import what ``engine``
may). ``registry.py`` is open to every layer. ``cli.py`` and the packages outside the library
layers (``testing``, ``bench``, ``recipes``, ``verl``) may import everything.

Known departures from the table are listed in ``KNOWN`` with the reason; a new departure fails,
and so does a listed one that no longer exists (delete its line).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "postrl"

MAY_IMPORT: dict[str, set[str]] = {
    "registry": set(),
    "protocol": set(),
    "algos": set(),
    "kernels": set(),
    "controller": {"protocol"},
    "engine": {"algos", "protocol", "kernels"},
    "workers": {"engine", "controller", "weights"},
    "rollout": {"protocol", "kernels"},
    "weights": {"engine", "rollout"},
    "agent": {"rollout", "tools", "envs"},
    "tools": set(),
    "envs": set(),
    "reward": set(),
    "data": {"protocol"},
    "trainer": {
        "protocol",
        "algos",
        "controller",
        "engine",
        "workers",
        "rollout",
        "weights",
        "agent",
        "tools",
        "reward",
        "data",
        "config",
        "tracking",
    },
    "supervised": {"engine", "data", "config"},
    "config": set(),
    "tracking": set(),
    "__init__": set(),
}
"""DESIGN.md's table (``trainer``: "everything above"). ``kernels`` (postrl's fused CPU kernels
in C and their build: issue 37) sits under both engines, ``engine`` and ``rollout``, which share
its build and vector math. ``supervised`` (SFT, reward-model
training: issue 33) sits beside ``trainer``, not above it: it trains with the engine on rows of
``data`` with options of ``config``, and runs no rollout, worker group or mode."""

UNRESTRICTED = {"cli", "testing", "bench", "recipes", "verl"}

OPEN_MODULES: dict[str, str] = {
    "postrl.engine.specs": "the engine's settings (torch-free dataclasses, importing nothing): "
    "the config composes their defaults so none is written twice (issue 33)",
}
"""Modules every layer may import, each with why (checked to import nothing of ours, no torch)."""

KNOWN: dict[tuple[str, str], str] = {
    ("config/validate.py", "algos"): "validation looks up registered estimators/losses lazily",
    ("data/code_tasks.py", "tools"): "the code task's reward runs in the tools sandbox",
    ("data/code_tasks.py", "reward"): "the code task registers its reward function",
    ("data/tool_arith.py", "tools"): "the tool-arith demonstrations call the calculator tool",
    ("data/tool_arith.py", "reward"): "the tool-arith task registers its reward function",
    ("reward/stage.py", "algos"): "the reward stage applies the overlong penalty",
    ("reward/stage.py", "protocol"): "the reward stage merges columns into a DataProto",
    ("rollout/client.py", "weights"): "weight frames decoded in the rollout client",
    ("rollout/ray_replica.py", "weights"): "weight frames encoded for a Ray replica",
    ("rollout/http_replica.py", "weights"): "weight frames encoded for a replica process",
    ("rollout/server.py", "weights"): "the HTTP server decodes weight frames it receives",
    ("rollout/server.py", "tools"): "the serving entry point wires a tool parser by name",
}
"""(module, imported layer) pairs that break the table today, each with why."""


def test_table_rows_name_real_layers():
    assert set().union(*MAY_IMPORT.values()) <= set(MAY_IMPORT)


def _allowed(layer: str) -> set[str]:
    """``layer``'s row closed transitively, plus ``registry`` and itself."""
    seen, todo = set(), [layer]
    while todo:
        for dep in MAY_IMPORT.get(todo.pop(), set()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen | {"registry", layer}


def _layer(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_layers(path: Path) -> set[str]:
    """First component under ``postrl`` of every absolute import in the module."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        out |= {n.split(".")[1] for n in names if n.startswith("postrl.") and n not in OPEN_MODULES}
    return out


def _violations() -> set[tuple[str, str]]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        layer = _layer(path)
        if layer in UNRESTRICTED:
            continue
        assert layer in MAY_IMPORT, f"{path}: new package {layer!r}; add its row (DESIGN.md)"
        rel = str(path.relative_to(ROOT))
        found |= {(rel, dep) for dep in _imported_layers(path) - _allowed(layer)}
    return found


def test_every_layer_imports_only_what_design_allows():
    found = _violations()
    new = sorted(found - set(KNOWN))
    assert not new, f"imports the layer table forbids (DESIGN.md): {new}"
    stale = sorted(set(KNOWN) - found)
    assert not stale, f"fixed departures, delete them from KNOWN: {stale}"


def test_engine_imports_only_algos_and_protocol():
    """engine/: no config, controller, weights, data, rollout, workers or trainer, even lazily."""
    files = sorted((ROOT / "engine").glob("*.py"))
    assert len(files) > 5
    ok = {"engine", "algos", "protocol", "kernels"}
    bad = {str(p.relative_to(ROOT)): sorted(_imported_layers(p) - ok) for p in files}
    assert not {k: v for k, v in bad.items() if v}


def test_importing_the_engine_loads_no_upper_layer():
    """Importing every engine module (a fresh interpreter) loads none of the layers above."""
    mods = [f"postrl.engine.{p.stem}" for p in sorted((ROOT / "engine").glob("*.py"))]
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(sorted({n.split('.')[1] for n in sys.modules if n.startswith('postrl.')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert loaded <= {"engine", "algos", "protocol", "kernels", "registry"}, loaded


def test_open_modules_import_nothing_and_keep_config_light():
    """An open module imports neither postrl nor torch; ``import postrl.config`` loads no torch."""
    for mod in OPEN_MODULES:
        path = ROOT.parent / (mod.replace(".", "/") + ".py")
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert imported <= {"__future__", "dataclasses", "typing"}, (mod, imported)
    code = "import sys, postrl.config\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
