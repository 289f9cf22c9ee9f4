"""Hyperparameters of registered algorithm functions, bound and checked once at startup.

A registered function (advantage estimator, policy loss) declares its hyperparameters as typed
**keyword-only** arguments with defaults; its remaining parameters are *inputs* (for a policy loss
the one :class:`~postrl.algos.LossInputs`; for an estimator batch tensors) that the caller
supplies on every call. :func:`hparam_errors` checks a mapping from the config
(``algorithm.adv_estimator_kwargs``, ``actor.policy_loss_kwargs``) against that signature — an
unknown or misspelt name is an error with a did-you-mean and the accepted names, a value of the
wrong type is an error naming the expected type — and :func:`bind_hparams` returns
the function with the checked values bound (``functools.partial``).

A function that takes ``**kwargs`` accepts any extra name (nothing can be checked for it) unless
the caller says its ``**kwargs`` only absorbs inputs (``open_kwargs=False``, advantage
estimators: they receive one uniform input set); declare hyperparameters explicitly to get the
check.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["hparam_names", "hparam_errors", "bind_hparams", "HParamError"]


class HParamError(ValueError):
    """Hyperparameters that do not fit a registered function; the message lists each problem."""


def hparam_names(fn: Callable[..., Any], inputs: Collection[str]) -> dict[str, Any]:
    """``{name: default}`` of ``fn``'s keyword hyperparameters (parameters with a default that
    are not in ``inputs``; ``**kwargs`` is not one)."""
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in inputs or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is not p.empty:
            out[p.name] = p.default
    return out


def _accepts_any(fn: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def _type_ok(value: Any, tp: Any) -> bool:
    """Whether a value fits annotation ``tp``: numbers, bool, str, None, list, dict; another
    class (a tensor, a generator) only by an instance; an unresolvable annotation: anything."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if origin in (list, tuple, Collection) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        inner = args[0] if args else Any
        return all(_type_ok(v, inner) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):  # tensors, generators: only a real one (never a YAML value)
        return isinstance(value, tp)
    return True


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def hparam_errors(
    fn: Callable[..., Any],
    given: Mapping[str, Any],
    *,
    inputs: Collection[str],
    owner: str,
    field: str,
    elsewhere: Mapping[str, str] | None = None,
    open_kwargs: bool = True,
) -> list[str]:
    """Every problem of ``given`` as hyperparameters of ``fn`` (empty list: all fine).

    Args:
        fn: the registered function.
        given: name -> value from the config.
        inputs: parameters the caller supplies per call (never hyperparameters).
        owner: what ``fn`` is, for messages (``"policy loss 'vanilla'"``).
        field: the config key holding ``given`` (``"actor.policy_loss_kwargs"``).
        elsewhere: hyperparameters that have a dedicated config field, name -> field; giving
            them in ``given`` is an error pointing at that field.
        open_kwargs: whether ``fn``'s ``**kwargs`` (if any) takes unknown hyperparameters.
    """
    names = hparam_names(fn, inputs)
    hints = _hints(fn)
    elsewhere = dict(elsewhere or {})
    errors = []
    for key, value in given.items():
        where = f"{field}.{key}"
        if key in elsewhere:
            errors.append(f"{where}: set {elsewhere[key]} instead (the dedicated field)")
        elif key in inputs:
            errors.append(
                f"{where}: {key!r} is an input of {owner} that the trainer supplies per batch, "
                "not a hyperparameter; remove it"
            )
        elif key not in names:
            if open_kwargs and _accepts_any(fn):
                continue
            close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            if close and close[0] in elsewhere:
                hint = f"; did you mean {close[0]!r} (set {elsewhere[close[0]]})?"
            accepted = ", ".join(sorted(set(names) - set(elsewhere))) or "(none)"
            errors.append(
                f"{where}: {owner} has no hyperparameter {key!r}{hint} Accepted: {accepted}"
            )
        elif not _type_ok(value, hints.get(key, Any)):
            errors.append(
                f"{where}={value!r}: {owner} expects {_type_name(hints.get(key))} "
                f"(default {names[key]!r})"
            )
    return errors


def bind_hparams(
    fn: Callable[..., Any],
    given: Mapping[str, Any],
    *,
    inputs: Collection[str],
    owner: str,
    field: str,
    common: Mapping[str, Any] | None = None,
    elsewhere: Mapping[str, str] | None = None,
    open_kwargs: bool = True,
) -> Callable[..., Any]:
    """``fn`` with ``given`` bound after :func:`hparam_errors` found nothing (else
    :class:`HParamError`). ``common`` values (shared settings such as ``actor.clip_ratio_low``)
    are bound only where ``fn`` declares them."""
    errors = hparam_errors(
        fn,
        given,
        inputs=inputs,
        owner=owner,
        field=field,
        elsewhere=elsewhere,
        open_kwargs=open_kwargs,
    )
    if errors:
        raise HParamError("; ".join(errors))
    names = hparam_names(fn, inputs)
    open_ = open_kwargs and _accepts_any(fn)
    shared = {k: v for k, v in (common or {}).items() if k in names or open_}
    bound = {**shared, **given}
    return functools.partial(fn, **bound) if bound else fn


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations (user code): skip the type check
        return {}
