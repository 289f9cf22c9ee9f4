"""The one ``Registry`` every postrl extension point uses.

Extension points (advantage estimators, policy losses, KL estimators, loss aggregation modes,
dispatch modes, rollout backends, weight-sync backends, agent loops, tools, reward functions,
trainer modes, metric sinks) each own one ``Registry``. Entries are either *eager* (an object
registered with the decorator) or *lazy* (an ``"module.path:attr"`` string imported on first
use, so heavy optional backends such as vLLM are never imported by ``import postrl``).

Entries may declare metadata (e.g. ``needs=("values",)``) which callers read instead of
special-casing names.

Example::

    ADV = Registry("advantage estimator")

    @ADV.register("grpo", needs=())
    def grpo(...): ...

    ADV.get("grpo")      # -> the function
    ADV.get("grpoo")     # KeyError: unknown advantage estimator 'grpoo'; did you mean 'grpo'? ...
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "RegistryError"]


class RegistryError(KeyError):
    """Raised for unknown or duplicate registry names; the message lists the valid choices."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """A named table of extension entries with did-you-mean errors.

    Args:
        kind: human-readable name of what is registered ("policy loss", "rollout backend"),
            used in error messages.
        install_hint: optional mapping name -> pip extra, used when a lazy entry fails to import.
    """

    def __init__(self, kind: str, install_hint: dict[str, str] | None = None) -> None:
        self.kind = kind
        self._eager: dict[str, T] = {}
        self._lazy: dict[str, str] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._install_hint = dict(install_hint or {})

    # ------------------------------------------------------------------ registration
    def register(self, name: str, *, override: bool = False, **meta: Any) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``; ``meta`` is stored alongside."""

        def deco(obj: T) -> T:
            self.add(name, obj, override=override, **meta)
            return obj

        return deco

    def add(self, name: str, obj: T, *, override: bool = False, **meta: Any) -> None:
        """Register ``obj`` under ``name`` (raises on duplicates unless ``override``)."""
        if not override and (name in self._eager or name in self._lazy):
            raise RegistryError(
                f"{self.kind} {name!r} is already registered; pick another name or pass "
                f"override=True to replace it"
            )
        # a module that registers the entry its lazy declaration names keeps the facts that
        # declaration stated (what it declares itself wins)
        declared = self._meta.get(name, {}) if self._lazy.pop(name, None) is not None else {}
        self._eager[name] = obj
        self._meta[name] = {**declared, **meta}

    def add_lazy(self, name: str, target: str, *, extra: str | None = None, **meta: Any) -> None:
        """Register ``"package.module:attr"`` to be imported on first ``get(name)``."""
        if name in self._eager or name in self._lazy:
            raise RegistryError(f"{self.kind} {name!r} is already registered")
        self._lazy[name] = target
        self._meta[name] = dict(meta)
        if extra:
            self._install_hint[name] = extra

    # ------------------------------------------------------------------ lookup
    def get(self, name: str) -> T:
        """Return the entry for ``name``; unknown names raise listing the choices."""
        if name in self._eager:
            return self._eager[name]
        if name in self._lazy:
            target = self._lazy[name]
            module_name, _, attr = target.partition(":")
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                hint = self._install_hint.get(name)
                fix = f"; install it with `pip install postrl[{hint}]`" if hint else ""
                raise ImportError(
                    f"{self.kind} {name!r} needs a package that is not installed ({e}){fix}"
                ) from e
            # Importing the module usually registers the entry eagerly via its decorator.
            if name in self._eager:
                return self._eager[name]
            obj = getattr(module, attr)
            self._lazy.pop(name, None)
            self._eager[name] = obj
            return obj
        raise RegistryError(self._unknown_message(name))

    def meta(self, name: str) -> dict[str, Any]:
        """Metadata declared when ``name`` was registered (empty dict if none)."""
        if name not in self:
            raise RegistryError(self._unknown_message(name))
        return dict(self._meta.get(name, {}))

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(set(self._eager) | set(self._lazy))

    def get_or_import(self, name: str, key: str) -> T:
        """A registered entry, or for ``"module:attr"`` (not itself registered) that attribute
        imported — how a config key names a user's class without registering it. An import
        failure raises ``ValueError`` naming ``key``; an unknown plain name, :meth:`get`'s
        error."""
        if ":" not in name or name in self:
            return self.get(name)
        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"{key}={name!r}: cannot import {attr!r} from {module_name!r} ({e}); give "
                f"'module:Class' of an importable class or one of {self.names()}"
            ) from e

    def check(self, name: str) -> str | None:
        """Return an error message if ``name`` is unknown, else None (for config validation)."""
        return None if name in self else self._unknown_message(name)

    def __contains__(self, name: object) -> bool:
        return name in self._eager or name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    def _unknown_message(self, name: str) -> str:
        choices = self.names()
        close = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"unknown {self.kind} {name!r}{hint} Registered: {', '.join(choices) or '(none)'}"
