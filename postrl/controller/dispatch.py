"""Dispatch modes: how a driver-side call is split across ranks and how results come back.

A worker method declares its distribution semantics with :func:`register`::

    class ActorWorker(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto: ...

and the driver calls ``actor_wg.compute_log_prob(batch)``; the :class:`WorkerGroup` looks up the
:class:`DispatchMode` by name in :data:`DISPATCH_MODES`, runs its ``dispatch_fn`` (driver args ->
one ``(args, kwargs)`` per rank, or ``None`` to skip a rank), executes, and runs its
``collect_fn`` on the per-rank outputs. New modes are *registered*
(:func:`register_dispatch_mode`), never special-cased at call sites.

Built-in modes (see ``docs/controller.md`` for diagrams):

=====================  ===============================================  ======================
mode                   dispatch                                          collect
=====================  ===============================================  ======================
``one_to_all``         same args to every rank                           list of outputs
``all_to_all``         every arg is a list; rank r gets ``arg[r]``       list of outputs
``rank_zero``          args to rank 0 only                               rank 0's output
``dp_compute``         like all_to_all, lengths checked == world size    list of outputs
``dp_compute_proto``   DataProto args padded + chunked over ranks        concat, then unpad
``nd_compute_proto:M`` chunked by the dp rank each worker registered      concat of ``is_collect``
                       for mesh M (tp/pp replicas get the same shard)    ranks, then unpad
=====================  ===============================================  ======================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from postrl.controller.errors import ControllerError
from postrl.protocol.data import DataProto
from postrl.registry import Registry

__all__ = [
    "DISPATCH_MODES",
    "Dispatch",
    "DispatchContext",
    "DispatchMode",
    "DispatchSpec",
    "DpInfo",
    "Execute",
    "RankCall",
    "get_dispatch_spec",
    "make_nd_compute_dispatch",
    "register",
    "register_dispatch_mode",
    "registered_methods",
]

RankCall = tuple[tuple[Any, ...], dict[str, Any]]
"""The ``(args, kwargs)`` one rank receives."""

SPEC_ATTR = "__postrl_dispatch__"


class Dispatch:
    """Names of the built-in dispatch modes (plain strings, usable as registry keys)."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"


class Execute:
    """Which ranks execute a call: ``ALL`` (those the dispatch addressed) or ``RANK_ZERO``."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class DpInfo:
    """Data-parallel coordinates a worker registered for one mesh (e.g. ``"actor"``).

    ``is_collect`` marks the one replica per dp rank whose output the driver keeps (e.g. tp
    rank 0 and the last pipeline stage).
    """

    dp_rank: int
    dp_size: int
    is_collect: bool = True


@dataclass
class DispatchContext:
    """Per-call context handed to ``dispatch_fn`` and ``collect_fn``.

    Attributes:
        world_size: number of workers in the group.
        method: the method being called (for error messages).
        role: the group's name.
        backend: backend name of the calling group (``"local"``, ``"ray"``).
        state: scratch dict a dispatch writes (e.g. ``pad_size``) and its collect reads.
        ranks: the ranks that executed, in the order of the ``outputs`` list given to collect.
    """

    world_size: int
    method: str
    role: str
    backend: str
    dp_info_fn: Callable[[str], list[DpInfo]]
    state: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)

    def dp_info(self, mesh_name: str) -> list[DpInfo]:
        """Per-rank :class:`DpInfo` for ``mesh_name`` (queried from the workers once, cached)."""
        return self.dp_info_fn(mesh_name)


DispatchFn = Callable[[DispatchContext, tuple, dict], Sequence["RankCall | None"]]
CollectFn = Callable[[DispatchContext, list], Any]


@dataclass(frozen=True)
class DispatchMode:
    """A named pair of split (``dispatch_fn``) and join (``collect_fn``) functions.

    Args:
        name: registry key.
        dispatch_fn: ``(ctx, args, kwargs) -> [RankCall | None] * world_size``.
        collect_fn: ``(ctx, outputs) -> result``; ``outputs[i]`` came from ``ctx.ranks[i]``.

    A :class:`~postrl.controller.future.GroupFuture` passed as an argument is resolved on the
    driver before ``dispatch_fn`` sees it.
    """

    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")


def register_dispatch_mode(
    name: str,
    dispatch_fn: DispatchFn,
    collect_fn: CollectFn,
    *,
    override: bool = False,
) -> DispatchMode:
    """Add a dispatch mode usable as ``@register(dispatch_mode=name)``; returns it."""
    mode = DispatchMode(name, dispatch_fn, collect_fn)
    DISPATCH_MODES.add(name, mode, override=override)
    return mode


def resolve_mode(mode: str | DispatchMode) -> DispatchMode:
    """Look up a mode by name (did-you-mean on typos) or pass a :class:`DispatchMode` through."""
    return mode if isinstance(mode, DispatchMode) else DISPATCH_MODES.get(mode)


@dataclass(frozen=True)
class DispatchSpec:
    """Distribution semantics stored on a worker method by :func:`register`.

    Attributes:
        dispatch_mode: registered mode name or a :class:`DispatchMode` object.
        execute_mode: :class:`Execute` value.
        blocking: group call returns the value (True) or a :class:`GroupFuture` (False).
        timeout_s: per-method deadline; ``None`` uses the group's default.
    """

    dispatch_mode: str | DispatchMode = Dispatch.ONE_TO_ALL
    execute_mode: str = Execute.ALL
    blocking: bool = True
    timeout_s: float | None = None

    @property
    def mode(self) -> DispatchMode:
        """The resolved :class:`DispatchMode`."""
        return resolve_mode(self.dispatch_mode)


def register(
    dispatch_mode: str | DispatchMode = Dispatch.ONE_TO_ALL,
    execute_mode: str = Execute.ALL,
    blocking: bool = True,
    timeout_s: float | None = None,
) -> Callable[[Callable], Callable]:
    """Decorate a :class:`Worker` method so :class:`WorkerGroup` exposes it with this dispatch.

    Unknown mode names raise at decoration time (listing the registered modes).
    """
    if isinstance(dispatch_mode, str):
        DISPATCH_MODES.get(dispatch_mode)  # fail fast with did-you-mean
    if execute_mode not in (Execute.ALL, Execute.RANK_ZERO):
        raise ControllerError(f"execute_mode={execute_mode!r}; choose 'all' or 'rank_zero'")
    if timeout_s is not None and timeout_s <= 0:
        raise ControllerError(
            f"timeout_s={timeout_s} must be positive (or None for the group default)"
        )
    spec = DispatchSpec(dispatch_mode, execute_mode, blocking, timeout_s)

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        setattr(inner, SPEC_ATTR, spec)
        return inner

    return deco


def get_dispatch_spec(fn: Any) -> DispatchSpec | None:
    """The :class:`DispatchSpec` stored on ``fn`` by :func:`register`, or None."""
    return getattr(fn, SPEC_ATTR, None)


def registered_methods(cls: type) -> dict[str, DispatchSpec]:
    """All ``@register``-ed methods of ``cls`` (including inherited ones), by name."""
    out: dict[str, DispatchSpec] = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        spec = get_dispatch_spec(getattr(cls, name, None))
        if spec is not None:
            out[name] = spec
    return out


# ---------------------------------------------------------------------------- helpers
def split_proto(ctx: DispatchContext, value: Any, n: int, arg_name: str) -> tuple[list[Any], int]:
    """Split a DataProto into ``n`` shards, padding when not divisible; rows by reference
    (``ref_shards``: the object-store data plane) shard themselves, so each rank receives
    references and materialises its own rows. Returns ``(shards, pad_size)``."""
    if hasattr(value, "ref_shards"):  # rows by reference: the batch shards itself, padded
        return list(value.ref_shards(n)), 0  # with masked rows (protocol/refs.py)
    if not isinstance(value, DataProto):
        raise ControllerError(
            f"{ctx.role}.{ctx.method}: {arg_name} must be a DataProto for a dp-split dispatch, "
            f"got {type(value).__name__}; wrap tensors with DataProto.from_dict or use one_to_all"
        )
    if len(value) == 0:
        raise ControllerError(f"{ctx.role}.{ctx.method}: {arg_name} is an empty DataProto")
    padded, pad = value.pad_to_divisor(n)
    return padded.chunk(n), pad


def _split_args(
    ctx: DispatchContext, args: tuple, kwargs: dict, n: int
) -> tuple[list[tuple], list[dict], int]:
    """Split every DataProto (or rows-by-reference) arg into ``n`` shards; broadcast the
    others."""
    pads: set[int] = set()
    split_args: list[list[Any]] = []
    for i, a in enumerate(args):
        if isinstance(a, DataProto) or hasattr(a, "ref_shards"):
            shards, pad = split_proto(ctx, a, n, f"positional arg {i}")
            pads.add(pad)
            split_args.append(shards)
        else:
            split_args.append([a] * n)
    split_kwargs: dict[str, list[Any]] = {}
    for k, v in kwargs.items():
        if isinstance(v, DataProto) or hasattr(v, "ref_shards"):
            shards, pad = split_proto(ctx, v, n, f"argument {k!r}")
            pads.add(pad)
            split_kwargs[k] = shards
        else:
            split_kwargs[k] = [v] * n
    if len(pads) > 1:
        raise ControllerError(
            f"{ctx.role}.{ctx.method}: DataProto arguments have different lengths"
        )
    per_args = [tuple(s[j] for s in split_args) for j in range(n)]
    per_kwargs = [{k: s[j] for k, s in split_kwargs.items()} for j in range(n)]
    return per_args, per_kwargs, (pads.pop() if pads else 0)


def _concat_unpad(outputs: list[Any], pad: int) -> Any:
    if outputs and all(isinstance(o, DataProto) for o in outputs):
        return DataProto.concat(outputs).unpad(pad)
    if outputs and all(isinstance(o, torch.Tensor) for o in outputs):
        cat = torch.cat(outputs, dim=0)
        return cat[: cat.shape[0] - pad] if pad else cat
    return outputs  # e.g. per-rank metric dicts


# ---------------------------------------------------------------------------- built-ins
def _one_to_all(ctx: DispatchContext, args: tuple, kwargs: dict) -> list[RankCall]:
    return [(args, kwargs)] * ctx.world_size


def _collect_list(ctx: DispatchContext, outputs: list) -> list:
    return list(outputs)


def _per_rank_lists(ctx: DispatchContext, args: tuple, kwargs: dict) -> list[RankCall]:
    n = ctx.world_size
    for name, v in [*((f"positional arg {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(v, (list, tuple)) or len(v) != n:
            got = len(v) if isinstance(v, (list, tuple)) else type(v).__name__
            raise ControllerError(
                f"{ctx.role}.{ctx.method}: {name} must be a list with one entry per rank "
                f"(world size {n}), got {got}"
            )
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(n)]


def _rank_zero(ctx: DispatchContext, args: tuple, kwargs: dict) -> list[RankCall | None]:
    return [(args, kwargs)] + [None] * (ctx.world_size - 1)


def _collect_first(ctx: DispatchContext, outputs: list) -> Any:
    return outputs[0]


def _dp_proto(ctx: DispatchContext, args: tuple, kwargs: dict) -> list[RankCall]:
    per_args, per_kwargs, pad = _split_args(ctx, args, kwargs, ctx.world_size)
    ctx.state["pad_size"] = pad
    return list(zip(per_args, per_kwargs))


def _collect_dp_proto(ctx: DispatchContext, outputs: list) -> Any:
    return _concat_unpad(outputs, ctx.state.get("pad_size", 0))


register_dispatch_mode(Dispatch.ONE_TO_ALL, _one_to_all, _collect_list)
register_dispatch_mode(Dispatch.ALL_TO_ALL, _per_rank_lists, _collect_list)
register_dispatch_mode(Dispatch.RANK_ZERO, _rank_zero, _collect_first)
register_dispatch_mode(Dispatch.DP_COMPUTE, _per_rank_lists, _collect_list)
register_dispatch_mode(Dispatch.DP_COMPUTE_PROTO, _dp_proto, _collect_dp_proto)


# ---------------------------------------------------------------------------- nd (mesh-aware)
def _check_layout(ctx: DispatchContext, mesh: str, infos: list[DpInfo]) -> int:
    sizes = {i.dp_size for i in infos}
    if len(sizes) != 1:
        raise ControllerError(
            f"{ctx.role}: workers registered different dp sizes {sorted(sizes)} for mesh {mesh!r}"
        )
    dp = sizes.pop()
    collectors = [0] * dp
    for r, info in enumerate(infos):
        if not 0 <= info.dp_rank < dp:
            raise ControllerError(
                f"{ctx.role} rank {r}: dp_rank {info.dp_rank} outside [0, {dp}) for mesh {mesh!r}"
            )
        collectors[info.dp_rank] += int(info.is_collect)
    bad = [d for d, c in enumerate(collectors) if c != 1]
    if bad:
        raise ControllerError(
            f"{ctx.role}: mesh {mesh!r} needs exactly one is_collect rank per dp rank; "
            f"dp ranks {bad} have {[collectors[d] for d in bad]}"
        )
    return dp


_ND_CACHE: dict[str, DispatchMode] = {}


def make_nd_compute_dispatch(mesh_name: str) -> DispatchMode:
    """A mesh-aware DataProto dispatch for ``mesh_name`` (e.g. ``"actor"``).

    On the first call the group asks every worker for the :class:`DpInfo` it registered for
    ``mesh_name`` (``Worker.register_dp_info``) and caches it. DataProto args are padded and
    chunked into ``dp_size`` shards; rank r receives shard ``dp_rank(r)``, so tensor/pipeline
    replicas of one dp rank get the same shard. Outputs are gathered only from ``is_collect``
    ranks, ordered by dp rank, concatenated and unpadded. The returned mode is also registered
    as ``"nd_compute_proto:<mesh_name>"``.
    """
    if mesh_name in _ND_CACHE:
        return _ND_CACHE[mesh_name]

    def dispatch(ctx: DispatchContext, args: tuple, kwargs: dict) -> list[RankCall]:
        infos = ctx.dp_info(mesh_name)
        dp = _check_layout(ctx, mesh_name, infos)
        per_args, per_kwargs, pad = _split_args(ctx, args, kwargs, dp)
        ctx.state["pad_size"] = pad
        return [(per_args[i.dp_rank], per_kwargs[i.dp_rank]) for i in infos]

    def _collect_order(ctx: DispatchContext, ranks: list) -> list[int]:
        infos = ctx.dp_info(mesh_name)
        picked = [(infos[r].dp_rank, j) for j, r in enumerate(ranks) if infos[r].is_collect]
        return [j for _, j in sorted(picked)]

    def collect(ctx: DispatchContext, outputs: list) -> Any:
        order = _collect_order(ctx, ctx.ranks)
        return _concat_unpad([outputs[j] for j in order], ctx.state.get("pad_size", 0))

    mode = register_dispatch_mode(f"nd_compute_proto:{mesh_name}", dispatch, collect, override=True)
    _ND_CACHE[mesh_name] = mode
    return mode
