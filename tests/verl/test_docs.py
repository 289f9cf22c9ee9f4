"""docs/verl.md is generated from the mapping table and must be current."""

from __future__ import annotations

from pathlib import Path

from postrl.verl import RULES
from postrl.verl.docs import render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"


def test_migration_guide_is_current():
    assert DOC.read_text() == render_markdown(), "run: python -m postrl.verl.docs"


def test_every_rule_is_documented_once():
    text = DOC.read_text()
    for rule in RULES:
        assert text.count(f"| `{rule.key}` |") == 1, rule.key
