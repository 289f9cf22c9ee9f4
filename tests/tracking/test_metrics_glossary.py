"""docs/metrics.md is the one glossary (STYLE.md rule 13): every metric the pinned runs emit
(``tests/trainer/pinned_numbers.json``: a sync GRPO run, PPO with a critic and KL in reward, a
``fully_async`` step) has a row there, and so has every metric key the package writes as a
literal. Static: reads files, runs nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def glossary_patterns() -> list[re.Pattern[str]]:
    """One regex per documented key: ``a/b/mean,max,min`` names three keys, ``a/x`` then a
    bare ``y`` names ``a/y``, ``<...>`` is one or more path segments, a trailing ``*`` any
    suffix."""
    out = []
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        parent = ""
        for cell in re.findall(r"`([^`]+)`", line.split("|")[1]):
            first, *rest = [a.strip() for a in cell.split(",")]
            if "/" not in first and parent:  # a bare name after `a/x`: `a/<name>`
                first = f"{parent}/{first}"
            parent = first.rsplit("/", 1)[0]
            for key in [first, *[a if "/" in a else f"{parent}/{a}" for a in rest]]:
                rx = re.escape(key).replace(r"\*", ".*")
                rx = re.sub(r"<[^>]+>", "[^ ]+", rx)
                out.append(re.compile(rx + "$"))
    return out


def test_every_pinned_metric_is_in_the_glossary():
    pinned = json.loads((ROOT / "tests" / "trainer" / "pinned_numbers.json").read_text())
    keys = {k for case, steps in pinned.items() if case != "_cpu" for s in steps for k in s}
    keys.discard("step")
    assert len(keys) > 50, keys
    pats = glossary_patterns()
    missing = sorted(k for k in keys if not any(p.match(k) for p in pats))
    assert not missing, f"metrics emitted but not in docs/metrics.md: {missing}"


NOT_METRICS = {"weights/bucket"}
"""Literals under a glossary prefix that name no metric (a replica call's label in errors)."""


def test_every_literal_metric_key_in_the_package_is_in_the_glossary():
    """A key written out in ``postrl/`` (``"async/admitted_groups"``) under a prefix the
    glossary uses is documented: a metric added without its row fails here, not only once a
    pinned run happens to emit it. ``postrl/bench/`` reports benchmark tables, not step
    metrics."""
    pats = glossary_patterns()
    prefixes = {p.pattern.split("/")[0] for p in pats}
    missing: dict[str, str] = {}
    for path in sorted((ROOT / "postrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("postrl/bench/"):
            continue
        for key in re.findall(
            r"[\"']([a-z_]+/[A-Za-z0-9_/@.-]*[A-Za-z0-9_])[\"']", path.read_text()
        ):
            if key.split("/")[0] not in prefixes or key in NOT_METRICS:
                continue
            if not any(p.match(key) or p.match(f"{key}/mean") for p in pats):  # (a stats prefix)
                missing.setdefault(key, rel)
    assert not missing, f"metric keys in postrl/ but not in docs/metrics.md: {missing}"
