"""The suite enforces the house lint: ruff (E, F, W, I, UP, B, T20 with E501 at 100 columns)
and ruff's formatting, over the package, tests, benchmarks and examples (pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["postrl", "tests", "benchmarks", "examples"]


def _ruff() -> str:
    exe = Path(sys.executable).with_name("ruff")
    found = str(exe) if exe.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(args):
    proc = subprocess.run(
        [_ruff(), *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_line_length_is_enforced():
    text = (ROOT / "pyproject.toml").read_text()
    assert "line-length = 100" in text
    ignore = next(ln for ln in text.splitlines() if ln.startswith("ignore"))
    assert "E501" not in ignore
