"""docs/metrics.md is the one glossary (STYLE.md rule 13): every metric the pinned runs emit
(``tests/trainer/pinned_numbers.json``: a sync GRPO run, PPO with a critic and KL in reward, a
``fully_async`` step) has a row there. Static: reads the two files, runs nothing."""

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
        for cell in re.findall(r"`([^`]+)`", line.split("|")[1]):
            first, *rest = [a.strip() for a in cell.split(",")]
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
