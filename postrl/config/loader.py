"""Load typed configs from YAML plus dotted ``key=value`` overrides (Hydra-style syntax).

``load_config("examples/grpo_addition.yaml", ["rollout.n=4", "trainer.total_steps=2"])``
returns a :class:`PostRLConfig`. Unknown keys are rejected with the closest valid name;
values are type-checked against the dataclass annotations (``"3"`` for an int field is parsed
by YAML rules first, so ``rollout.n=4`` gives the int 4).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from postrl.config.schema import PostRLConfig, config_key

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "load_config",
    "load_options",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "dump_config",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the field, the value and the fix."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return _from_dict(tp, value, where)
    if origin is list:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [value]  # a single file path for a list field is a common, harmless shorthand
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0] if args else Any, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def _from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    hints = _hints(cls)
    by_key = {config_key(f): f.name for f in dataclasses.fields(cls)}
    names = list(by_key)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in by_key:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"; did you mean {(where + '.' if where else '') + close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown config key {path!r}{hint} Valid keys here: {', '.join(names)}"
            )
        kwargs[by_key[key]] = _coerce(value, hints[by_key[key]], path)
    return cls(**kwargs)


def from_dict(data: dict[str, Any]) -> PostRLConfig:
    """Build a :class:`PostRLConfig` from a nested mapping (unknown keys raise)."""
    return _from_dict(PostRLConfig, data or {})


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain-dict form of a config dataclass, keyed as in YAML (``trainer.async``)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {config_key(f): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to a nested dict, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. rollout.n=4)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(data, key, value)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PostRLConfig:
    """Read YAML at ``path`` (optional), apply ``overrides``, return the typed config."""
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    apply_overrides(data, list(overrides or []))
    return from_dict(data)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    loaded = yaml.safe_load(p.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at top level")
    return loaded


def load_options(
    cls: type[T],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    section: str = "",
    required: tuple[str, ...] = (),
) -> T:
    """Options of a flat dataclass ``cls`` (e.g. ``postrl sft``'s :class:`SFTConfig`) from YAML
    at ``path`` (its ``section:`` mapping when it has one) plus ``key=value`` overrides.

    Every problem is reported at once in one :class:`ConfigError`: unknown keys (with the
    closest valid name), values of the wrong type and ``required`` fields left empty.
    """
    data: dict[str, Any] = _read_yaml(path) if path is not None else {}
    if section and isinstance(data.get(section), dict):
        data = data[section]
    apply_overrides(data, list(overrides or []))
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    where = f"{section} option" if section else "option"
    errors, kwargs = [], {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            errors.append(f"unknown {where} {key!r}{hint} Valid keys: {', '.join(names)}")
            continue
        try:
            kwargs[key] = _coerce(value, hints[key], key)
        except ConfigError as e:
            errors.append(str(e))
    errors += [
        f"{key}: required (set {key}=...)" for key in required if not kwargs.get(key, data.get(key))
    ]
    if errors:
        head = f"{len(errors)} problem(s) in the {section or cls.__name__} options:"
        raise ConfigError("\n".join([head, *(f"  - {e}" for e in errors)]))
    return cls(**kwargs)


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (the run directory keeps one)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
