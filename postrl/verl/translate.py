"""Translate verl's launch keys into a :class:`~postrl.config.PostRLConfig` through ``RULES``.

``translate(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", ...])`` returns a
:class:`Translation`: the typed postrl config, the nested dict it was built from, and one
note per accepted key that has no effect here (``--print-config`` prints the config's
differences from postrl's defaults, headed by the notes). Every
rejected or unknown key is collected and reported at once in a :class:`VerlConfigError`, each
with the reason and the nearest supported setting (unknown keys: a did-you-mean among verl's
keys).

``postrl.<key>=value`` arguments set postrl keys directly, after the translation, for what verl
has no key for (``postrl.rollout.num_replicas=2``).
"""

from __future__ import annotations

import copy
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

from postrl.config import ConfigError, PostRLConfig, from_dict
from postrl.verl.hydra import INTERPOLATION, Override, parse_override
from postrl.verl.mapping import RULES, TOP_LEVEL
from postrl.verl.rules import Ref, Rule, Unsupported

logger = logging.getLogger(__name__)

__all__ = ["Translation", "VerlConfigError", "translate", "lookup_rule", "flatten"]

_BY_KEY: dict[str, Rule] = {r.key: r for r in RULES if not r.is_tree}
_DICT_RULES = sorted(
    (r for r in RULES if not r.is_tree and isinstance(r.default, dict)),
    key=lambda r: -len(r.key),
)
_TREES = sorted((r for r in RULES if r.is_tree), key=lambda r: -len(r.key))
_POSTRL = "postrl."


class VerlConfigError(ConfigError):
    """verl keys that cannot be translated; the message lists every one with reason and fix."""


@dataclass
class Translation:
    """The result of :func:`translate`."""

    config: PostRLConfig
    """The typed postrl configuration (not yet validated against files and registries)."""
    postrl: dict[str, Any]
    """The nested postrl dict the config was built from (every key a rule wrote)."""
    notes: list[str] = field(default_factory=list)
    """One line per verl key that is accepted but has no effect here."""
    verl: dict[str, Any] = field(default_factory=dict)
    """The verl keys the user set, after parsing (``key -> value``)."""
    val_only: bool = False
    """``trainer.val_only=True``: validate once instead of training."""


def lookup_rule(key: str) -> Rule | None:
    """The rule that handles verl ``key`` (exact key, mapping-valued parent, or subtree)."""
    if key in _BY_KEY:
        return _BY_KEY[key]
    for r in _DICT_RULES:
        if key.startswith(r.prefix):
            return r
    for r in _TREES:
        if key.startswith(r.prefix):
            return r
    return None


def _did_you_mean(key: str) -> str:
    top = key.split(".")[0]
    if top not in TOP_LEVEL:
        close = difflib.get_close_matches(top, TOP_LEVEL, n=1, cutoff=0.5)
        if close:
            return f"did you mean {close[0] + key[len(top) :]!r}?"
        return f"verl's config groups are: {', '.join(TOP_LEVEL)}"
    names = [k for k in _BY_KEY if k.startswith(top + ".")]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not close:  # same leaf name under another group (critic.lr -> critic.optim.lr)
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in names if k.rsplit(".", 1)[-1] == leaf][:1]
    if close:
        return f"did you mean {close[0]!r}?"
    return f"see docs/verl.md for the keys under {top!r}"


class _View:
    """Resolved verl values: the user's, else verl's default (interpolations followed)."""

    def __init__(self, user: dict[str, Any]) -> None:
        self.user = user
        self.notes: list[str] = []

    def is_set(self, key: str) -> bool:
        return key in self.user

    def get(self, key: str, _depth: int = 0) -> Any:
        if _depth > 20:
            raise Unsupported(f"interpolation cycle at {key!r}", "set the key to a value")
        if key in self.user:
            value = self.user[key]
        else:
            rule = _BY_KEY.get(key)
            value = copy.deepcopy(rule.default) if rule is not None else None
        if isinstance(value, Ref):
            return self.get(value.key, _depth + 1)
        if isinstance(value, str):
            m = INTERPOLATION.match(value)
            if m:
                return self.get(m.group(1), _depth + 1)
        return value

    def note(self, key: str, text: str) -> None:
        line = f"verl {key}: {text}"
        if line not in self.notes:
            self.notes.append(line)


def _merge(out: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = out
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        node[parts[-1]] = {**node[parts[-1]], **value}
    else:
        node[parts[-1]] = copy.deepcopy(value)


def flatten(tree: dict[str, Any], prefix: str = "") -> list[Override]:
    """A nested verl YAML mapping as overrides (mapping-valued keys stay whole)."""
    out: list[Override] = []
    for k, v in tree.items():
        key = f"{prefix}{k}"
        rule = _BY_KEY.get(key)
        if isinstance(v, dict) and v and not (rule is not None and isinstance(rule.default, dict)):
            out.extend(flatten(v, key + "."))
        else:
            out.append(Override(key, v, "set", f"{key}: {v!r} (config file)"))
    return out


def _parse(args: list[str], errors: list[str]) -> list[Override]:
    out = []
    for arg in args:
        try:
            out.append(parse_override(arg))
        except ValueError as e:
            errors.append(str(e))
    return out


def _collect(
    overrides: list[Override], errors: list[str]
) -> tuple[dict[str, Any], list[tuple[str, Any]], dict]:
    """Sort overrides into user verl values (by rule key), postrl passthroughs, and matches."""
    user: dict[str, Any] = {}
    passthrough: list[tuple[str, Any]] = []
    matched: dict[str, list[tuple[str, Any]]] = {}
    for o in overrides:
        if o.key.startswith(_POSTRL):
            passthrough.append((o.key[len(_POSTRL) :], o.value))
            continue
        rule = lookup_rule(o.key)
        if rule is None:
            errors.append(f"{o.key}: not a verl config key; {_did_you_mean(o.key)}")
            continue
        if o.op == "delete":
            user.pop(rule.key if not rule.is_tree else o.key, None)
            continue
        if not rule.is_tree and isinstance(rule.default, dict) and o.key != rule.key:
            sub = o.key[len(rule.prefix) :]
            base = user.get(rule.key, copy.deepcopy(rule.default))
            node = base
            parts = sub.split(".")
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[parts[-1]] = o.value
            user[rule.key] = base
            matched.setdefault(rule.key, [(rule.key, base)])[0] = (rule.key, base)
            continue
        user[o.key] = o.value
        matched.setdefault(rule.key, []).append((o.key, o.value))
    return user, passthrough, matched


def _apply(rule: Rule, view: _View, matched: dict, out: dict, errors: list[str]) -> None:
    hits = matched.get(rule.key, [])
    if rule.kind == "map":
        if not hits and getattr(rule.convert, "platform_default", False):
            return  # the engine adapter's per-platform default, not verl's GPU one
        value = view.get(rule.key)
        try:
            result = rule.convert(value, view) if rule.convert else {rule.to: value}
        except Unsupported as e:
            fix = f"; nearest supported: {e.nearest}" if e.nearest else ""
            errors.append(f"{rule.key}={value!r}: {e.why}{fix}")
            return
        for k, v in result.items():
            _merge(out, k, v)
        why = getattr(rule.convert, "why", None)
        if hits and not result and why:
            view.note(rule.key, f"{value!r} has no effect here: {why}")
        return
    default = None if rule.is_tree else rule.default
    if isinstance(default, Ref):
        default = view.get(default.key)
    for key, value in hits:
        accepted = rule.kind == "noop" or value == default or value in rule.ok
        if accepted:
            view.note(key, f"{value!r} has no effect here: {rule.why}")
        else:
            fix = f"; nearest supported: {rule.nearest}" if rule.nearest else ""
            errors.append(f"{key}={value!r} is not supported: {rule.why}{fix}")


def _postrl_origin(message: str) -> str:
    """Name the verl key behind a postrl key in a postrl config error."""
    hints = []
    for r in RULES:
        if r.kind == "map" and r.to and r.to.split(" ")[0] in message:
            hints.append(r.key)
    return f" (set from verl {', '.join(sorted(set(hints))[:3])})" if hints else ""


def translate(args: list[str], base: dict[str, Any] | None = None) -> Translation:
    """Translate verl ``key=value`` arguments into postrl's typed config.

    Args:
        args: Hydra-style overrides, as on verl's command line.
        base: a nested verl config (a YAML file given with ``--config-name``); ``args`` win.

    Raises:
        VerlConfigError: listing every unknown, rejected or untranslatable key at once.
    """
    errors: list[str] = []
    overrides = flatten(base or {}) + _parse(list(args), errors)
    user, passthrough, matched = _collect(overrides, errors)
    view = _View(user)
    out: dict[str, Any] = {}
    for rule in RULES:
        _apply(rule, view, matched, out, errors)
    if errors:
        raise VerlConfigError(
            f"{len(errors)} verl key(s) cannot be used here:\n  - " + "\n  - ".join(errors)
        )
    try:
        for key, value in passthrough:
            _merge(out, key, value)
        cfg = from_dict(out)
    except ConfigError as e:
        raise VerlConfigError(f"{e}{_postrl_origin(str(e))}") from e
    for line in view.notes:
        logger.info("%s", line)
    return Translation(
        config=cfg,
        postrl=out,
        notes=list(view.notes),
        verl=dict(user),
        val_only=bool(view.get("trainer.val_only")),
    )
