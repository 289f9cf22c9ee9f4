"""Data planes (``trainer.async.data_plane``) and the one table of what each carries.

A data plane is where finished trajectories travel between the rollout and the training
workers; its registry entry names its :class:`~postrl.trainer.runner.TrajectoryRunner` and
declares its facts:

* ``rollout_side``: trajectories run, are scored and stay on the rollout side (the replicas are
  Ray actors of their own with a payload owner:
  :class:`~postrl.rollout.dedicated.DedicatedReplicas`);
* ``rules``: a tuple of :class:`PlaneRule`, **the one table** of the features the plane carries
  differently from the ``driver`` plane: ``fetched`` (the taken groups come to the driver for a
  stage that reads tensors there; :func:`~postrl.trainer.ref_batch.driver_tensor_reasons` reads
  these rows) or ``refused`` (config validation reports the row, naming the key and the fix).
  ``python -m postrl.config.docs`` renders the table into ``docs/config.md``.

Config validation and the docs generator look the registry up by name (``config`` imports no
layer above it); nothing outside a plane's own file branches on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from postrl.registry import Registry

__all__ = [
    "DATA_PLANES",
    "FETCHED",
    "REFUSED",
    "PlaneRule",
    "plane_rules",
    "plane_refusals",
]

FETCHED = "fetched"
"""A rule's ``how``: carried by fetching the taken groups to the driver (the step then runs as
on the ``driver`` plane, counted as ``driver/*`` traffic on channel ``object_store.fetch``)."""
REFUSED = "refused"
"""A rule's ``how``: config validation refuses the combination."""


@dataclass(frozen=True)
class PlaneRule:
    """One row of a plane's table.

    Attributes:
        feature: what the user turned on, as config keys (a docs cell).
        applies: ``cfg -> str``: the feature as this config sets it (``""``: not on).
        how: :data:`FETCHED` or :data:`REFUSED`.
        why: why the plane cannot carry it by reference (a docs cell and the error's reason).
        fix: what to set instead (``REFUSED`` rows).
    """

    feature: str
    applies: Callable[[Any], str]
    how: str
    why: str
    fix: str = ""

    def error(self, cfg: Any, plane: str) -> str | None:
        """The config error of this row for ``cfg`` (a ``REFUSED`` row that applies), else None."""
        on = self.applies(cfg)
        if self.how != REFUSED or not on:
            return None
        return (
            f"{on} with trainer.async.data_plane={plane}: {self.why}; {self.fix} (or set "
            f"trainer.async.data_plane=driver)"
        )


DATA_PLANES: Registry[type] = Registry("data plane")
"""``trainer.async.data_plane`` values → runner classes, with the facts above."""


def plane_rules(name: str) -> tuple[PlaneRule, ...]:
    """The table of plane ``name`` (unknown names raise with the choices)."""
    return tuple(DATA_PLANES.meta(name).get("rules", ()))


def plane_refusals(cfg: Any) -> list[str]:
    """The config errors of ``cfg``'s data plane: every ``REFUSED`` row that applies (an
    unknown plane: the registry's message, naming the choices)."""
    name = cfg.trainer.async_.data_plane
    msg = DATA_PLANES.check(name)
    if msg:
        return [f"trainer.async.data_plane={name!r}: {msg}"]
    return [e for r in plane_rules(name) if (e := r.error(cfg, name)) is not None]


# ---------------------------------------------------------------------- the object-store table
def _token_estimator(cfg: Any) -> str:
    from postrl.algos import ADV_ESTIMATORS

    name = cfg.algorithm.adv_estimator
    if name not in ADV_ESTIMATORS:
        return ""
    meta = ADV_ESTIMATORS.meta(name)
    if not meta.get("outcome") or meta.get("needs") or meta.get("optional"):
        return f"algorithm.adv_estimator={name} (token-level inputs)"
    return ""


def _backend(cfg: Any) -> str:
    b = cfg.trainer.backend
    return "" if b == "ray" else f"trainer.backend={b}"


def _mode(cfg: Any) -> str:
    from postrl.trainer.modes import TRAINER_MODES

    m = cfg.trainer.mode
    if m not in TRAINER_MODES or TRAINER_MODES.meta(m).get("object_store"):
        return ""
    own = sorted(n for n in TRAINER_MODES.names() if TRAINER_MODES.meta(n).get("object_store"))
    return f"trainer.mode={m} (modes that declare object_store: {', '.join(own)})"


def _segments(cfg: Any) -> str:
    from postrl.agent import AGENT_LOOPS

    name = cfg.rollout.agent.default_agent_loop
    if name not in AGENT_LOOPS or not AGENT_LOOPS.meta(name).get("segments"):
        return ""
    return f"rollout.agent.default_agent_loop={name} (its runs may become several rows)"


def _on(key: str, value: Callable[[Any], Any], off: Any = False) -> Callable[[Any], str]:
    def applies(cfg: Any) -> str:
        v = value(cfg)
        return "" if v == off or v in (None, "") else f"{key}={str(v).lower()}"

    return applies


OBJECT_STORE_RULES: tuple[PlaneRule, ...] = (
    PlaneRule(
        "`trainer.backend` other than `ray`",
        _backend,
        REFUSED,
        "trajectories live in Ray's object store between rollout replica actors of their own "
        "and the training workers",
        "set trainer.backend=ray",
    ),
    PlaneRule(
        "a `trainer.mode` that does not declare `object_store`",
        _mode,
        REFUSED,
        "the mode does not run its trajectories on rollout replica actors of their own",
        "set trainer.mode to one that declares it",
    ),
    PlaneRule(
        "`reward.model.enable=true`",
        _on("reward.model.enable", lambda c: c.reward.model.enable),
        REFUSED,
        "the replicas score their groups without the reward model (it runs on the trainer's "
        "workers)",
        "set reward.model.enable=false",
    ),
    PlaneRule(
        "`trainer.async.idle_switch` other than `never`",
        _on("trainer.async.idle_switch", lambda c: c.trainer.async_.idle_switch, "never"),
        REFUSED,
        "the idle switch loads the actor's weights into a replica in the trainer process, whose "
        "trajectories would come back to the driver",
        "set trainer.async.idle_switch=never",
    ),
    PlaneRule(
        "an agent loop registered with `segments` (one run, several rows)",
        _segments,
        REFUSED,
        "the plane carries one row per sample",
        "use an agent loop without segments",
    ),
    PlaneRule(
        "a token-level `algorithm.adv_estimator` (GAE with a critic, ReMax, OTB, ...)",
        _token_estimator,
        FETCHED,
        "the estimator reads token tensors (values, a baseline) on the driver",
    ),
    PlaneRule(
        "`algorithm.use_kl_in_reward=true`",
        _on("algorithm.use_kl_in_reward", lambda c: c.algorithm.use_kl_in_reward),
        FETCHED,
        "the KL penalty is written into the token rewards on the driver",
    ),
    PlaneRule(
        "`algorithm.downsample.enable=true`",
        _on("algorithm.downsample.enable", lambda c: c.algorithm.downsample.enable),
        FETCHED,
        "downsampling chooses rows from their token scores on the driver",
    ),
    PlaneRule(
        "`algorithm.rollout_correction.rollout_rs`",
        _on(
            "algorithm.rollout_correction.rollout_rs",
            lambda c: c.algorithm.rollout_correction.rollout_rs,
            None,
        ),
        FETCHED,
        "rejection sampling masks tokens before the advantage on the driver",
    ),
    PlaneRule(
        "a distillation teacher (`distill.teacher_path` / `teacher_url`)",
        lambda c: "distill.teacher_path / teacher_url" if c.distill.enabled else "",
        FETCHED,
        "the teacher scores the sampled tokens on the driver",
    ),
)
"""What the ``object_store`` plane carries differently (module docstring)."""


DATA_PLANES.add_lazy("driver", "postrl.trainer.runner:LocalRunner", rollout_side=False, rules=())
DATA_PLANES.add_lazy(
    "object_store",
    "postrl.trainer.object_store:ObjectStoreRunner",
    rollout_side=True,
    rules=OBJECT_STORE_RULES,
)
