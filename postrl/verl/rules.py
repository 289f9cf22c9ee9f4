"""The vocabulary of the verl mapping table: one :class:`Rule` per verl key (or key subtree).

A rule says what happens to a verl key, whether the user set it or verl's default applies:

* ``map``: the value (the user's, else verl's default) becomes one or more postrl settings,
  through ``convert(value, view) -> {postrl_key: value}`` or, without a converter, directly
  into ``to``. Defaults flow too, so verl's defaults hold unless a postrl-only concern differs
  (each such case logs a line).
* ``noop``: accepted; when the user sets it, one line is logged saying why it has no effect.
* ``reject``: only verl's default (and the values in ``ok``) are accepted, as no-ops; any other
  value stops the translation with the reason and the nearest supported setting.

A key ending in ``.*`` covers every key under it (profilers, Megatron options, ...). A rule
whose default is a mapping (``engine_kwargs.vllm``) collects ``key.sub=value`` arguments into
that mapping. ``Ref("other.key")`` as a default is verl's interpolation ``${other.key}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Rule", "Ref", "Unsupported", "M", "N", "R", "NOOP_TREE", "REJECT_TREE"]


@dataclass(frozen=True)
class Ref:
    """verl's ``${key}`` interpolation: the default is whatever ``key`` resolves to."""

    key: str

    def __repr__(self) -> str:
        return "${" + self.key + "}"


class Unsupported(ValueError):
    """Raised by a converter: this value has no postrl equivalent (``nearest`` says what does)."""

    def __init__(self, why: str, nearest: str = "") -> None:
        super().__init__(why)
        self.why = why
        self.nearest = nearest


Converter = Callable[[Any, Any], dict[str, Any]]


@dataclass(frozen=True)
class Rule:
    """How one verl key (or a ``prefix.*`` subtree) is handled; see the module docstring."""

    key: str
    default: Any
    kind: str
    to: str = ""
    convert: Converter | None = None
    why: str = ""
    nearest: str = ""
    ok: tuple[Any, ...] = ()

    @property
    def is_tree(self) -> bool:
        """True for ``prefix.*`` rules."""
        return self.key.endswith(".*")

    @property
    def prefix(self) -> str:
        """``a.b.`` for ``a.b.*`` (and for mapping-valued rules: the key plus a dot)."""
        return self.key[:-1] if self.is_tree else self.key + "."


def M(key: str, default: Any, to: str, convert: Converter | None = None, why: str = "") -> Rule:
    """A ``map`` rule: verl ``key`` (default ``default``) sets postrl ``to``."""
    return Rule(key, default, "map", to=to, convert=convert, why=why)


def N(key: str, default: Any, why: str) -> Rule:
    """A ``noop`` rule: accepted, logged with ``why`` when set."""
    return Rule(key, default, "noop", why=why)


def R(key: str, default: Any, why: str, nearest: str, ok: tuple[Any, ...] = ()) -> Rule:
    """A ``reject`` rule: values other than ``default`` and ``ok`` stop with ``why``/``nearest``."""
    return Rule(key, default, "reject", why=why, nearest=nearest, ok=ok)


def NOOP_TREE(prefix: str, why: str) -> Rule:
    """Every key under ``prefix`` is accepted and logged with ``why``."""
    return Rule(prefix + ".*", None, "noop", why=why)


def REJECT_TREE(prefix: str, why: str, nearest: str) -> Rule:
    """Every key under ``prefix`` is rejected (falsy values such as ``enable=False`` pass)."""
    return Rule(prefix + ".*", None, "reject", why=why, nearest=nearest, ok=(False, None, 0, ""))
