"""Startup validation: every problem at once, each with the field, the value, why and the fix.

Runs before any model is loaded. Registry-backed choices (estimators, losses, backends, ...)
are checked against the registries, imported lazily so ``postrl.config`` stays light.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from postrl.config.loader import ConfigError
from postrl.config.schema import PostRLConfig

__all__ = ["validate_config", "ConfigError", "old_log_prob_fusion_blockers", "dtype_errors"]


def _registry_checks(cfg: PostRLConfig) -> list[str]:
    errors: list[str] = []
    checks = [
        ("postrl.algos", "ADV_ESTIMATORS", "algorithm.adv_estimator", cfg.algorithm.adv_estimator),
        ("postrl.algos", "POLICY_LOSSES", "actor.policy_loss", cfg.actor.policy_loss),
        ("postrl.algos", "AGG_MODES", "actor.loss_agg_mode", cfg.actor.loss_agg_mode),
        ("postrl.algos", "KL_ESTIMATORS", "actor.kl_loss_type", cfg.actor.kl_loss_type),
        ("postrl.algos", "KL_ESTIMATORS", "algorithm.kl_penalty", cfg.algorithm.kl_penalty),
        ("postrl.rollout", "ROLLOUT_BACKENDS", "rollout.backend", cfg.rollout.backend),
        (
            "postrl.agent",
            "AGENT_LOOPS",
            "rollout.agent.default_agent_loop",
            cfg.rollout.agent.default_agent_loop,
        ),
        ("postrl.trainer", "TRAINER_MODES", "trainer.mode", cfg.trainer.mode),
        (
            "postrl.tools.parsers",
            "TOOL_PARSERS",
            "rollout.agent.tool_parser",
            cfg.rollout.agent.tool_parser,
        ),
    ]
    if cfg.distill.enabled:
        checks.append(("postrl.algos.distill", "DISTILL_LOSSES", "distill.loss", cfg.distill.loss))
    if ":" not in cfg.data.sampler:
        checks.append(("postrl.data.samplers", "PROMPT_SAMPLERS", "data.sampler", cfg.data.sampler))
    for module, attr, key, value in checks:
        registry = _declared(module, attr)
        if registry is None:
            continue  # component not installed in this build; its own import will say so
        msg = registry.check(value)
        if msg:
            errors.append(f"{key}={value!r}: {msg}")
    return errors


def _declared(module: str, attr: str) -> Any:
    """A registry (or a function over the declared facts) of another layer, looked up by name
    when validation runs: ``config`` imports no layer, and names no mode, estimator or backend —
    it asks the owners. None when that layer is not installed in this build."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def mode_facts(cfg: PostRLConfig) -> dict[str, Any]:
    """The registry metadata ``trainer.mode`` declared (``postrl/trainer/modes.py``: e.g.
    ``on_policy``, ``config_errors``, ``minibatch_steps``, ``dedicated_rollout``,
    ``idle_switch``); empty for an unknown mode (the registry check reports it)."""
    modes = _declared("postrl.trainer", "TRAINER_MODES")
    if modes is None or modes.check(cfg.trainer.mode):
        return {}
    return dict(modes.meta(cfg.trainer.mode))


_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_COMPUTE_NAMES = ("auto", "float32", "bfloat16")
_WIDTH = {"float32": 32, "bfloat16": 16, "float16": 16}


def dtype_errors(dtype: str, compute_dtype: str) -> list[str]:
    """Problems with ``model.dtype`` / ``model.compute_dtype`` (empty list: fine)."""
    e = []
    if dtype not in _DTYPE_NAMES:
        e.append(f"model.dtype={dtype!r} is not one of {list(_DTYPE_NAMES)}")
    if compute_dtype not in _COMPUTE_NAMES:
        why = (
            " (float16 training needs loss scaling, which postrl does not do; use bfloat16)"
            if compute_dtype == "float16"
            else ""
        )
        e.append(f"model.compute_dtype={compute_dtype!r} is not one of {list(_COMPUTE_NAMES)}{why}")
    elif dtype in _WIDTH and compute_dtype in _WIDTH and _WIDTH[compute_dtype] > _WIDTH[dtype]:
        e.append(
            f"model.compute_dtype={compute_dtype} is wider than model.dtype={dtype}: computing in "
            f"more precision "
            f"than the weights are stored in gains nothing; set model.dtype=float32 (mixed "
            f"precision) or "
            f"model.compute_dtype={dtype}"
        )
    elif (
        dtype in _WIDTH
        and compute_dtype in _WIDTH
        and dtype != compute_dtype
        and _WIDTH[dtype] == 16
    ):
        e.append(
            f"model.dtype={dtype} with model.compute_dtype={compute_dtype}: two different 16-bit "
            f"formats; "
            f"store in float32 (model.dtype=float32) or compute in {dtype}"
        )
    return e


def validate_config(
    cfg: PostRLConfig, *, check_files: bool = True, check_registries: bool = True
) -> None:
    """Raise :class:`ConfigError` listing every problem found in ``cfg``."""
    e: list[str] = []
    d, a, r, t = cfg.data, cfg.actor, cfg.rollout, cfg.trainer

    if not cfg.model.path:
        e.append(
            "model.path is empty: set it to a Hugging Face model directory (create a tiny one with "
            "`postrl make-model runs/tiny`)"
        )
    elif check_files and not Path(cfg.model.path).exists():
        e.append(
            f"model.path={cfg.model.path!r} does not exist: create it with `postrl make-model "
            f"{cfg.model.path}` or fix the path"
        )
    e.extend(dtype_errors(cfg.model.dtype, cfg.model.compute_dtype))
    if cfg.model.kernels not in ("auto", "fused", "torch"):
        e.append(
            f"model.kernels={cfg.model.kernels!r} is not one of ['auto', 'fused', 'torch']: "
            "use auto (fused CPU kernels when they build), fused (required) or torch"
        )
    rm = cfg.reward.model
    if rm.enable:
        if not rm.path:
            e.append(
                "reward.model.enable=True but reward.model.path is empty: point it at a "
                "sequence-classification "
                "model directory (`postrl make-model DIR --head reward` makes a tiny one)"
            )
        elif check_files and not Path(rm.path).exists():
            e.append(f"reward.model.path={rm.path!r} does not exist")
        if rm.mode not in ("replace", "add"):
            e.append(f"reward.model.mode={rm.mode!r} must be 'replace' or 'add'")
        for key, value in (
            ("reward.model.max_length", rm.max_length),
            ("reward.model.micro_batch_size", rm.micro_batch_size),
        ):
            if value < 1:
                e.append(f"{key}={value} must be >= 1")
    if t.checkpoint_format not in ("full", "sharded"):
        e.append(f"trainer.checkpoint_format={t.checkpoint_format!r} must be 'full' or 'sharded'")
    if check_files:
        for key, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
            for f in files:
                if not Path(f).exists():
                    e.append(
                        f"{key} contains {f!r}, which does not exist: write it with `postrl data "
                        f"addition {f}` or fix the path"
                    )
    if not d.train_files:
        e.append("data.train_files is empty: give at least one parquet file")

    for key, value in (
        ("data.train_batch_size", d.train_batch_size),
        ("rollout.n", r.n),
        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
        ("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu),
        ("actor.ppo_epochs", a.ppo_epochs),
        ("rollout.response_length", r.response_length),
        ("data.max_prompt_length", d.max_prompt_length),
        ("trainer.num_workers", t.num_workers),
        ("rollout.verify_probe_every", r.verify_probe_every),
    ):
        if value < 1:
            e.append(f"{key}={value} must be >= 1")

    if (
        d.train_batch_size >= 1
        and a.ppo_mini_batch_size >= 1
        and d.train_batch_size % a.ppo_mini_batch_size
    ):
        e.append(
            f"data.train_batch_size={d.train_batch_size} is not divisible by "
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}: "
            f"each step must split into whole mini-batches; set actor.ppo_mini_batch_size to a "
            f"divisor of "
            f"{d.train_batch_size} (e.g. {math.gcd(d.train_batch_size, a.ppo_mini_batch_size)})"
        )
    from postrl.algos.downsample import DOWNSAMPLE_RULES  # lazily: torch

    dsc = cfg.algorithm.downsample
    if dsc.enable and not 2 <= dsc.size < r.n:
        e.append(
            f"algorithm.downsample.size={dsc.size} must be in [2, rollout.n={r.n}): a group needs "
            f"two responses for a relative advantage and fewer than it generated; raise rollout.n "
            f"or set algorithm.downsample.enable=false"
        )
    if dsc.rule not in DOWNSAMPLE_RULES:
        e.append(
            f"algorithm.downsample.rule={dsc.rule!r}: expected one of {list(DOWNSAMPLE_RULES)}"
        )
    dp = t.num_workers if t.backend == "ray" else 1
    group = cfg.train_group_size
    if dp > 1 and a.ppo_mini_batch_size >= 1 and group >= 1:
        per_mini = a.ppo_mini_batch_size * group
        if per_mini % dp:
            step = dp // math.gcd(group, dp)
            what = "algorithm.downsample.size" if dsc.enable else "rollout.n"
            e.append(
                f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} × {what}={group} = {per_mini} "
                f"responses per mini-batch "
                f"is not divisible by trainer.num_workers={dp}: set actor.ppo_mini_batch_size to a "
                f"multiple of {step}"
            )
    if d.truncation not in ("error", "filter"):
        e.append(f"data.truncation={d.truncation!r} must be 'error' or 'filter'")
    if t.backend not in ("local", "ray"):
        e.append(f"trainer.backend={t.backend!r} must be 'local' or 'ray'")
    if t.backend == "local" and t.num_workers != 1:
        e.append(
            f"trainer.num_workers={t.num_workers} needs trainer.backend=ray (the local backend "
            f"runs one in-process worker)"
        )
    if t.device not in ("cpu", "cuda"):
        e.append(f"trainer.device={t.device!r} must be 'cpu' or 'cuda'")
    if not (0 < a.clip_ratio_low < 1 and 0 < a.clip_ratio_high):
        e.append(
            f"actor.clip_ratio_low={a.clip_ratio_low}/clip_ratio_high={a.clip_ratio_high}: need 0 "
            f"< low < 1 and high > 0"
        )
    for key, value in (("actor.strategy", a.strategy), ("critic.strategy", cfg.critic.strategy)):
        if value not in ("fsdp2", "ddp"):
            e.append(
                f"{key}={value!r} must be 'fsdp2' (shard the model over dp ranks) or 'ddp' (full "
                f"replica per rank)"
            )
    if a.clip_ratio_c <= 1:
        e.append(f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip lower bound)")
    if a.entropy_target < 0:
        e.append(
            f"actor.entropy_target={a.entropy_target} must be >= 0 (0 = a fixed entropy_coeff; "
            "> 0 = the entropy in nats the adaptive coefficient holds)"
        )
    elif a.entropy_target > 0 and not (
        a.entropy_coeff_step > 0
        and 0 <= a.entropy_coeff_min <= a.entropy_coeff <= a.entropy_coeff_max
    ):
        e.append(
            f"actor.entropy_target={a.entropy_target} needs actor.entropy_coeff_step > 0 (got "
            f"{a.entropy_coeff_step}) and 0 <= actor.entropy_coeff_min <= actor.entropy_coeff "
            f"<= actor.entropy_coeff_max (got {a.entropy_coeff_min}, {a.entropy_coeff} and "
            f"{a.entropy_coeff_max}): raise entropy_coeff_max or set the starting "
            "entropy_coeff between the bounds"
        )
    if r.temperature < 0:
        e.append(f"rollout.temperature={r.temperature} must be >= 0")
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if not 0 <= cfg.reward.max_failure_ratio <= 1:
        e.append(f"reward.max_failure_ratio={cfg.reward.max_failure_ratio} must be in [0, 1]")
    e.extend(_agent_loop_errors(cfg))
    if not 0 <= r.agent.env.gamma <= 1:
        e.append(
            f"rollout.agent.env.gamma={r.agent.env.gamma} must be in [0, 1] (1 = sum the "
            "episode's per-turn rewards)"
        )
    if (
        cfg.trainer.resume_mode not in ("auto", "disable")
        and check_files
        and not Path(cfg.trainer.resume_mode).exists()
    ):
        e.append(
            f"trainer.resume_mode={cfg.trainer.resume_mode!r} is neither auto/disable nor an "
            f"existing checkpoint path"
        )
    if a.fuse_old_log_prob:
        for why in old_log_prob_fusion_blockers(cfg):
            e.append(
                f"actor.fuse_old_log_prob=True but {why}: set actor.fuse_old_log_prob=null (auto) "
                f"or false"
            )
    if t.total_steps < 0 or t.total_epochs < 1:
        e.append(
            f"trainer.total_steps={t.total_steps} must be >= 0 and "
            f"trainer.total_epochs={t.total_epochs} >= 1"
        )
    if t.time_budget_s < 0:
        e.append(f"trainer.time_budget_s={t.time_budget_s} must be >= 0 (0 = no time limit)")
    bad_marks = [s for s in t.test_at_s if not s > 0]
    if bad_marks:
        e.append(
            f"trainer.test_at_s={t.test_at_s}: every mark must be > 0 seconds of training "
            f"(got {bad_marks})"
        )

    e.extend(distill_errors(cfg, check_files))
    e.extend(async_errors(cfg))
    if check_registries:
        e.extend(_registry_checks(cfg))
        e.extend(_algorithm_checks(cfg))

    if e:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(e))


def distill_errors(cfg: PostRLConfig, check_files: bool = True) -> list[str]:
    """Problems with ``distill.*`` (the tokenizer check needs the files and runs at trainer
    startup: :func:`postrl.trainer.teacher.check_teacher_tokenizer`)."""
    d, e = cfg.distill, []
    if d.teacher_path and d.teacher_url:
        e.append(
            f"distill.teacher_path={d.teacher_path!r} and distill.teacher_url={d.teacher_url!r} "
            "are both set: one teacher per run; unset one of them"
        )
    if d.teacher_path and check_files and not Path(d.teacher_path).exists():
        e.append(
            f"distill.teacher_path={d.teacher_path!r} does not exist: point it at the teacher's "
            "Hugging Face directory (or serve the teacher and set distill.teacher_url)"
        )
    if d.baseline not in ("none", "mean"):
        e.append(
            f"distill.baseline={d.baseline!r} must be 'none' (k_t as it is) or 'mean' (the "
            "batch's mean reverse KL subtracted)"
        )
    if d.teacher_url and not d.teacher_url.startswith(("http://", "https://")):
        e.append(f"distill.teacher_url={d.teacher_url!r} must start with http:// or https://")
    for key, value, ok, why in (
        ("distill.coef", d.coef, d.coef >= 0, ">= 0"),
        ("distill.task_reward_weight", d.task_reward_weight, d.task_reward_weight >= 0, ">= 0"),
        ("distill.topk", d.topk, d.topk >= 1, ">= 1"),
        ("distill.beta", d.beta, 0 <= d.beta <= 1, "in [0, 1]"),
        ("distill.timeout_s", d.timeout_s, d.timeout_s > 0, "> 0"),
    ):
        if not ok:
            e.append(f"{key}={value} must be {why}")
    return e


_TAKE_ORDERS = ("completion", "admission")  # the replay buffer's TAKE_ORDERS (a layer above)


def take_order(cfg: PostRLConfig) -> str:
    """``trainer.async.take_order`` resolved: as set, or for ``auto`` the order the mode
    declared (its registered ``take_order`` fact; ``completion`` when it declares none) —
    ``completion`` when ``trainer.sampler`` names another sampler, which only a take in
    completion order consults."""
    order = cfg.trainer.async_.take_order
    if order != "auto":
        return order
    if cfg.trainer.sampler != "oldest_first":
        return "completion"
    return str(mode_facts(cfg).get("take_order", "completion"))


def async_errors(cfg: PostRLConfig) -> list[str]:
    """Problems with ``trainer.async.*``, ``trainer.health.*`` and ``trainer.sampler`` (each
    names the key, the value and the fix)."""
    t, ac, h = cfg.trainer, cfg.trainer.async_, cfg.trainer.health
    e = []
    if ac.staleness_strategy not in ("drop", "wait"):
        e.append(
            f"trainer.async.staleness_strategy={ac.staleness_strategy!r} must be 'drop' (evict "
            f"groups older than the bound, refill them) or 'wait' (never drop)"
        )
    order = take_order(cfg)
    if ac.take_order not in ("auto", *_TAKE_ORDERS):
        e.append(
            f"trainer.async.take_order={ac.take_order!r} must be 'completion' (take groups as "
            f"they complete), 'admission' (take the groups admitted first, none overtaking) or "
            f"'auto' (the mode's own)"
        )
    elif order not in _TAKE_ORDERS:
        e.append(
            f"trainer.mode={t.mode} declares take_order={order!r} in its registry "
            f"entry (trainer.async.take_order=auto takes it): a mode declares 'completion' or "
            f"'admission'; or set trainer.async.take_order"
        )
    elif ac.take_order == "admission" and t.sampler != "oldest_first":
        e.append(
            f"trainer.sampler={t.sampler!r} with trainer.async.take_order=admission: an "
            f"admission-order take does not consult a sampler; use trainer.async.take_order="
            f"completion to choose groups with it"
        )
    if ac.num_warmup_batches < 0:
        e.append(f"trainer.async.num_warmup_batches={ac.num_warmup_batches} must be >= 0")
    if ac.timeout_s <= 0:
        e.append(f"trainer.async.timeout_s={ac.timeout_s} must be > 0 (seconds)")
    if not 0 <= h.min_ess_ratio <= 1:
        e.append(f"trainer.health.min_ess_ratio={h.min_ess_ratio} must be in [0, 1] (0 = off)")
    if h.staleness_alert_steps < 0:
        e.append(f"trainer.health.staleness_alert_steps={h.staleness_alert_steps} must be >= 0")
    if h.no_signal_alert_steps < 0:
        e.append(
            f"trainer.health.no_signal_alert_steps={h.no_signal_alert_steps} must be >= 0 (0 = off)"
        )
    facts = mode_facts(cfg)
    if ac.idle_switch != "never" and not facts.get("idle_switch"):
        e.append(
            f"trainer.async.idle_switch={ac.idle_switch} with trainer.mode={t.mode}: the idle "
            f"switch lends the trainer's cores to generation in a mode whose replicas run on "
            f"devices of their own (in {t.mode} the trainer's devices generate anyway); set "
            f"trainer.async.idle_switch=never"
        )
    fg = cfg.algorithm.filter_groups
    if fg.enable and fg.refill and fg.oversample and not facts.get("oversample"):
        e.append(
            f"algorithm.filter_groups.oversample=true with trainer.mode={t.mode}: this mode "
            f"keeps its own number of groups in flight (trainer.async.max_staleness + 1 "
            f"batches); set algorithm.filter_groups.oversample=false"
        )
    if facts.get("config_errors") is not None:  # what the mode asks of the config
        e.extend(facts["config_errors"](cfg))
    e.extend(data_plane_errors(cfg))  # every mode: a plane a mode cannot use is refused
    samplers = _declared("postrl.trainer.asynchronous.replay.samplers", "SAMPLERS")
    if samplers is not None and ":" not in t.sampler and samplers.check(t.sampler):
        e.append(f"trainer.sampler={t.sampler!r}: {samplers.check(t.sampler)}")
    return e


def data_plane_errors(cfg: PostRLConfig) -> list[str]:
    """Problems with ``trainer.async.data_plane``, in every mode: the ``refused`` rows of the
    plane's one table that apply (``postrl/trainer/planes.py``, rendered into docs/config.md;
    a stage that reads batch tensors on the driver is a ``fetched`` row, carried), or an
    unknown plane."""
    refusals = _declared("postrl.trainer.planes", "plane_refusals")
    return [] if refusals is None else list(refusals(cfg))


def step_groups(cfg: PostRLConfig) -> int:
    """Prompt groups one step trains: ``data.train_batch_size``, or one mini-batch in a mode
    whose steps are mini-batches (registered ``minibatch_steps``)."""
    if mode_facts(cfg).get("minibatch_steps"):
        return cfg.actor.ppo_mini_batch_size
    return cfg.data.train_batch_size


def old_log_prob_fusion_blockers(cfg: PostRLConfig) -> list[str]:
    """Why old log-probs cannot come from the update's own forward (empty: they can).

    Fusion is exact only for an on-policy update — one mini-batch, one epoch — and when nothing
    before the update reads the old log-probs (KL in the reward, rollout IS weights/rejection).
    """
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    out = []
    if a.ppo_epochs != 1:
        out.append(f"actor.ppo_epochs={a.ppo_epochs} (epochs after the first are off-policy)")
    if a.ppo_mini_batch_size != step_groups(cfg):
        out.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} != "
            f"data.train_batch_size={cfg.data.train_batch_size} "
            "(mini-batches after the first are off-policy)"
        )
    if cfg.algorithm.use_kl_in_reward:
        out.append(
            "algorithm.use_kl_in_reward=True (the reward needs old log-probs before the update)"
        )
    if rc.rollout_is or rc.rollout_rs:
        out.append(
            "algorithm.rollout_correction.rollout_is/rollout_rs is set (the weights need old "
            "log-probs before the update)"
        )
    if rc.bypass_mode:
        out.append(
            "algorithm.rollout_correction.bypass_mode=True (old log-probs are the rollout's)"
        )
    if not mode_facts(cfg).get("on_policy") and not _reads_proximal(cfg):
        out.append(
            f"trainer.mode={cfg.trainer.mode!r} is off-policy (its batches were generated by "
            "older weights, so the update's own forward is not the behaviour policy; "
            "actor.policy_loss=decoupled takes μ from the rollout and may fuse)"
        )
    if _agent_loop_facts(cfg).get("segments"):
        out.append(
            f"rollout.agent.default_agent_loop={cfg.rollout.agent.default_agent_loop!r} may "
            "turn one run into several rows (segments), so a step's batch can exceed one "
            "mini-batch"
        )
    out.extend(_need_blockers(cfg))
    return out


def _agent_loop_facts(cfg: PostRLConfig) -> dict:
    """The registry metadata of ``rollout.agent.default_agent_loop`` (``postrl/agent``: e.g.
    ``segments``: one run may yield several rows; ``config_errors``: ``"module:function"``
    checking ``rollout.agent``); empty for an unknown loop (the registry check reports it)."""
    import importlib

    try:
        loops = importlib.import_module("postrl.agent").AGENT_LOOPS
    except (ImportError, AttributeError):
        return {}
    name = cfg.rollout.agent.default_agent_loop
    return {} if loops.check(name) else dict(loops.meta(name))


def _agent_loop_errors(cfg: PostRLConfig) -> list[str]:
    """Errors the default agent loop declares for ``rollout.agent`` (its ``config_errors``)."""
    target = _agent_loop_facts(cfg).get("config_errors")
    if not target:
        return []
    import importlib

    module, _, attr = str(target).partition(":")
    return list(getattr(importlib.import_module(module), attr)(cfg.rollout.agent))


def _reads_proximal(cfg: PostRLConfig) -> bool:
    reads_proximal = _declared("postrl.trainer.needs", "reads_proximal")
    return bool(reads_proximal and reads_proximal(cfg))


def _need_blockers(cfg: PostRLConfig) -> list[str]:
    """Declared needs read before the update (``postrl.trainer.needs``: e.g. the optimal token
    baseline's ``old_log_probs`` and ``sum_pi_squared``)."""
    fusion_blockers = _declared("postrl.trainer.needs", "fusion_blockers")
    return fusion_blockers(cfg) if fusion_blockers is not None else []


def _algorithm_checks(cfg: PostRLConfig) -> list[str]:
    """Declared needs have a producer that can run (``postrl.trainer.needs``); estimator and
    policy-loss hyperparameters fit the functions' typed keyword arguments (did-you-mean)."""
    try:
        from postrl.algos import (
            ADV_ESTIMATORS,
            POLICY_LOSSES,
            adv_estimator_hparam_errors,
            policy_loss_hparam_errors,
        )
    except ImportError:
        return []
    check_needs = _declared("postrl.trainer.needs", "check_needs")
    e = check_needs(cfg) if check_needs is not None else []
    est, loss = cfg.algorithm.adv_estimator, cfg.actor.policy_loss
    if est in ADV_ESTIMATORS:
        e.extend(adv_estimator_hparam_errors(est, cfg.algorithm.adv_estimator_kwargs))
    if loss in POLICY_LOSSES:
        e.extend(policy_loss_hparam_errors(loss, cfg.actor.policy_loss_kwargs))
        free = POLICY_LOSSES.meta(loss).get("zero_advantage_rows_free", False)
        if cfg.actor.skip_zero_advantage and not free:
            e.append(
                f"actor.skip_zero_advantage=true with actor.policy_loss={loss!r}: this loss does "
                "not declare that a zero-advantage row adds nothing to it "
                "(zero_advantage_rows_free; e.g. it selects tokens by batch statistics): set "
                "actor.skip_zero_advantage=false or use a loss that declares it"
            )
    return e
