"""Library code never imports ``postrl.testing`` (DESIGN.md, Layers).

Only the layers on top may: ``postrl/testing/`` itself, the benchmarks (``postrl/bench/``), the
demos (``postrl/recipes/``) and ``postrl/cli.py``. Fault injection reaches the trainer as a
callback a test installs (``postrl.trainer.hooks``), not as an import.

The scan reads every module's AST: ``import postrl.testing[...]``, ``from postrl.testing[...]
import``, ``from postrl import testing``, relative imports that resolve into ``postrl.testing``,
and string constants that name it as an import path (``importlib.import_module("postrl.testing")``,
a lazy registry entry ``"postrl.testing.x:Y"``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "postrl"
ALLOWED = ("testing/", "bench/", "recipes/", "cli.py")  # relative to postrl/
_PATH_STRING = re.compile(r"postrl\.testing(?:[.:][\w.:]*)?")


def _module_name(rel: str) -> str:
    parts = ["postrl", *rel[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_testing(name: str) -> bool:
    return name == "postrl.testing" or name.startswith("postrl.testing.")


def _testing_imports(source: str, rel: str) -> list[str]:
    """``"line N: what"`` for every reference to ``postrl.testing`` as an import in ``source``."""
    package = _module_name(rel).split(".")
    if not rel.endswith("__init__.py"):
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(source, filename=rel)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _PATH_STRING.fullmatch(node.value):
                names = [node.value.split(":")[0]]
        hits = [n for n in names if _is_testing(n)]
        if hits:
            found.append(f"line {node.lineno}: {hits[0]}")
    return found


def _library_modules() -> list[str]:
    rels = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py"))
    return [r for r in rels if not r.startswith(ALLOWED)]


def test_the_scan_catches_every_form_of_import():
    rel = "trainer/x.py"
    sources = [
        "import postrl.testing",
        "import postrl.testing.faults as f",
        "from postrl.testing import make_model",
        "from postrl.testing.faults import install_kill_at",
        "from postrl import testing",
        "from .. import testing",
        "from ..testing.faults import KillAt",
        "def f():\n    from postrl.testing import make_model",
        "import importlib\nimportlib.import_module('postrl.testing.faults')",
        "LAZY = {'x': 'postrl.testing.servers:Server'}",
    ]
    for src in sources:
        assert _testing_imports(src, rel), src
    clean = [
        "import postrl.trainer.hooks",
        "from postrl.trainer.hooks import fire",
        "from . import testing_utils",
        "from .testing import x",  # postrl.trainer.testing, not postrl.testing
        "DOC = 'tests install a hook from postrl.testing.faults (see there)'",
    ]
    for src in clean:
        assert not _testing_imports(src, rel), src
    assert _testing_imports("from . import faults", "testing/__init__.py")


def test_no_library_module_imports_postrl_testing():
    modules = _library_modules()
    assert len(modules) > 50 and "trainer/trainer.py" in modules, "the scan must see the library"
    offenders = []
    for rel in modules:
        found = _testing_imports((ROOT / rel).read_text(encoding="utf-8"), rel)
        if found:
            offenders.append(f"postrl/{rel} ({'; '.join(found)})")
    assert not offenders, (
        "library code must not import postrl.testing: " + ", ".join(offenders) + ". Install a "
        "callback from the test instead (postrl.trainer.hooks for fault points), or move the code "
        "to postrl/bench/ or postrl/recipes/ if it is a benchmark or a demo."
    )
