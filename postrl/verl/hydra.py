"""Parse verl's Hydra-style command-line overrides into ``(key, value)`` pairs.

verl's launch scripts pass ``key=value`` arguments in Hydra's override grammar. The subset that
launch scripts use is accepted here:

* ``key=value`` (set), ``+key=value`` (add a key the schema lacks), ``++key=value`` (force),
  ``~key`` / ``~key=value`` (delete: the key falls back to verl's default);
* values: ``null``; ``true``/``false`` in any case; integers and floats as Hydra reads them
  (``1e-6`` is a float, which YAML 1.1 would read as a string); lists ``[a,b]`` and
  ``['x.parquet', 'y.parquet']``; mappings ``{a:1}``; a quoted string keeps its text;
  ``${other.key}`` is an interpolation, resolved later against the other keys.

Shell quoting has already been removed by the shell; a value still wrapped in one pair of
quotes (``data.truncation='error'`` passed without a shell) has them stripped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["Override", "parse_override", "parse_value", "INTERPOLATION"]

_INT = re.compile(r"^[+-]?\d+$")
_FLOAT = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.I)
#: ``${a.b.c}`` (also Hydra's ``${oc.select:a.b.c,default}``): a reference to another key.
INTERPOLATION = re.compile(r"^\$\{(?:oc\.select:)?([\w.]+)(?:,[^}]*)?\}$")


@dataclass(frozen=True)
class Override:
    """One parsed argument: ``op`` is ``set``, ``add``, ``force`` or ``delete``."""

    key: str
    value: Any
    op: str
    raw: str


def _scalar(text: str) -> Any:
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    low = s.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.match(s):
        return int(s)
    if _FLOAT.match(s):
        return float(s)
    return s


def _fix(value: Any) -> Any:
    """Re-read strings YAML left alone but Hydra would type (``1e-6``, ``None`` stays text)."""
    if isinstance(value, list):
        return [_fix(v) for v in value]
    if isinstance(value, dict):
        return {k: _fix(v) for k, v in value.items()}
    if isinstance(value, str):
        return _scalar(value) if _FLOAT.match(value.strip()) else value
    return value


def parse_value(raw: str) -> Any:
    """The Python value of a Hydra override's right-hand side (see the module docstring)."""
    s = raw.strip()
    if s.startswith(("[", "{")):
        try:
            return _fix(yaml.safe_load(s))
        except yaml.YAMLError:
            return s
    return _scalar(s)


def parse_override(arg: str) -> Override:
    """Parse one ``[+|++|~]key[=value]`` argument.

    Raises:
        ValueError: the argument has no ``=`` (and is not a deletion) or an empty key.
    """
    text = arg.strip()
    op = "set"
    if text.startswith("++"):
        op, text = "force", text[2:]
    elif text.startswith("+"):
        op, text = "add", text[1:]
    elif text.startswith("~"):
        op, text = "delete", text[1:]
    if "=" not in text:
        if op == "delete" and text:
            return Override(text, None, op, arg)
        raise ValueError(
            f"argument {arg!r} is not a verl override: write key=value "
            f"(e.g. actor_rollout_ref.rollout.n=4)"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"argument {arg!r} has an empty key")
    return Override(key, parse_value(raw), op, arg)
