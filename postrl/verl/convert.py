"""Converters and helpers used by the verl mapping table (:mod:`postrl.verl.mapping`).

A converter takes ``(value, view)``, where ``value`` is the verl key's resolved value and
``view`` answers ``get(key)``, ``is_set(key)`` and ``note(key, text)`` for the other keys, and
returns ``{postrl_key: value}`` (a mapping value is merged into what other rules wrote). It
raises :class:`~postrl.verl.rules.Unsupported` for a value postrl cannot honour.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Any

from postrl.verl.rules import Unsupported

A = "actor_rollout_ref.actor"
RO = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
MOD = "actor_rollout_ref.model"
C = "critic"

_NO_OFFLOAD = (
    "postrl does not offload parameters or optimizer state; on CPU everything already lives in "
    "host memory, on GPUs FSDP2 shards them over the ranks (trainer.n_gpus_per_node)"
)
_PADFREE = "postrl's forward passes are always padding-free (packed varlen)"
_LOGPROB_MB = (
    "log-prob passes (old, reference) reuse the actor's micro-batching "
    "(ppo_micro_batch_size_per_gpu, or use_dynamic_bsz with ppo_max_token_len_per_gpu)"
)
_PROFILER = "verl's profilers (nsys, npu, torch) are not wired; postrl reports timing_s/* per stage"
_MEGATRON = "postrl has no Megatron engine"
_MEGATRON_NEAR = f"{A}.strategy=fsdp (postrl's FSDP2 engine)"
_NO_SP = "postrl has no sequence parallelism"
_SP_NEAR = f"{A}.use_dynamic_bsz=True with a smaller {A}.ppo_max_token_len_per_gpu"
_ROLLOUT_ONLY = "applies to verl's own rollout engines only"
_CPU_ENGINES = "no effect on postrl's CPU engines (native, hf); passed on to vLLM/SGLang"
_SEED = "postrl derives every seed (data order, init, sampling) from trainer.seed (data.seed)"


# ---------------------------------------------------------------------------- helpers
def _expand(path: Any) -> Any:
    return os.path.expanduser(os.path.expandvars(path)) if isinstance(path, str) else path


def _to(key: str):
    """Converter writing the value unchanged to ``key``."""
    return lambda v, view: {key: v}


def _path(key: str):
    return lambda v, view: {key: _expand(v) if v else ""}


def _files(key: str):
    def conv(v, view):
        if v is None:
            return {key: []}
        items = v if isinstance(v, (list, tuple)) else [v]
        return {key: [_expand(str(x)) for x in items]}

    return conv


def _int_or_zero(key: str):
    """verl's ``null``/``-1`` (off, or 'derive it') is postrl's 0."""
    return lambda v, view: {key: 0 if v is None or v < 0 else int(v)}


def backend_of(view: Any) -> str:
    """The postrl rollout backend for ``actor_rollout_ref.rollout.name`` (``???`` = unset)."""
    name = view.get(f"{RO}.name")
    return "native" if name in (None, "???", "") else str(name)


def _rollout_name(v, view):
    if v in (None, "???", ""):
        view.note(
            f"{RO}.name",
            "not set (verl requires it): using postrl's CPU engine (rollout.backend=native)",
        )
        return {"rollout.backend": "native"}
    if v in ("native", "hf"):
        return {"rollout.backend": v}
    if v in ("vllm", "sglang"):
        from postrl.rollout.base import ROLLOUT_BACKENDS, replica_python, runs_in_own_process

        own = runs_in_own_process(v) and replica_python(v) != sys.executable
        if not own and importlib.util.find_spec(v) is None:  # (own: its venv, checked at start)
            hint = ROLLOUT_BACKENDS.meta(v).get("setup", "")  # how its entry says to get it
            raise Unsupported(
                f"{v} is not installed here; {hint}`pip install 'postrl[{v}]'`",
                f"{RO}.name=native (postrl's CPU engine, no extra needed) or {RO}.name=hf",
            )
        return {"rollout.backend": v}
    raise Unsupported(f"postrl has no {v!r} rollout engine", f"{RO}.name=vllm (GPU) or native")


def _engine(
    vllm_key: str | None,
    sglang_key: str | None = None,
    why: str = _CPU_ENGINES,
    platform_default: bool = False,
):
    """Pass a vLLM/SGLang engine argument through ``rollout.engine_kwargs``; a no-op elsewhere.
    ``platform_default``: the engine adapter picks this argument per platform (vLLM on CPU:
    eager, no chunked prefill with per-request seeds; ``vllm_backend.engine_defaults``), so only
    a value the user set is passed: verl's default (a GPU setting) gives way."""

    def conv(v, view):
        b = backend_of(view)
        target = {"vllm": vllm_key, "sglang": sglang_key}.get(b)
        if target:
            return {"rollout.engine_kwargs": {target: v}}
        return {}

    conv.why = why  # type: ignore[attr-defined]
    conv.platform_default = platform_default  # type: ignore[attr-defined]
    return conv


def _engine_kwargs(which: str):
    def conv(v, view):
        if not v:
            return {}
        if backend_of(view) == which:
            return {"rollout.engine_kwargs": dict(v)}
        return {}

    return conv


def _tp(v, view):
    b = backend_of(view)
    if b == "vllm":
        return {"rollout.engine_kwargs": {"tensor_parallel_size": int(v)}}
    if b == "sglang":
        return {"rollout.engine_kwargs": {"tp_size": int(v)}}
    return {}


_tp.platform_default = True  # type: ignore[attr-defined]  (verl's default 2 is a GPU layout)


_tp.why = (  # type: ignore[attr-defined]
    "postrl's CPU engines (native, hf) run one process per replica; passed on to vLLM/SGLang"
)


def _strategy(v, view):
    if v in ("fsdp", "fsdp2"):
        return {"actor.strategy": "fsdp2"}
    raise Unsupported(f"strategy {v!r} has no postrl engine", _MEGATRON_NEAR)


def _critic_strategy(v, view):
    if v in ("fsdp", "fsdp2"):
        return {"critic.strategy": "fsdp2"}
    raise Unsupported(f"strategy {v!r} has no postrl engine", f"{C}.strategy=fsdp")


def _micro(prefix: str, to: str):
    """``ppo_micro_batch_size_per_gpu``, falling back to verl's global ``ppo_micro_batch_size``."""

    def conv(v, view):
        if v is None:
            legacy = view.get(f"{prefix}.ppo_micro_batch_size")
            if legacy is not None:
                v = max(1, int(legacy) // max(1, world_size(view)))
        if v is None:
            if prefix == C and not needs_critic(view):
                return {}  # verl checks the critic's sizes only when a critic is built
            if not view.get(f"{prefix}.use_dynamic_bsz"):
                raise Unsupported(
                    "verl needs a micro-batch size when use_dynamic_bsz is off",
                    f"{prefix}.ppo_micro_batch_size_per_gpu=4 or {prefix}.use_dynamic_bsz=True",
                )
            return {}
        return {to: int(v)}

    return conv


def world_size(view: Any) -> int:
    """Devices verl would use: ``trainer.nnodes × trainer.n_gpus_per_node``."""
    return int(view.get("trainer.nnodes") or 1) * int(view.get("trainer.n_gpus_per_node") or 1)


def device_of(view: Any) -> str:
    """``trainer.device``: verl's default ``cuda`` becomes ``cpu`` where no GPU is visible."""
    v = view.get("trainer.device")
    if v == "cuda" and not view.is_set("trainer.device"):
        import torch

        if not torch.cuda.is_available():
            return "cpu"
    return str(v)


def _device(v, view):
    d = device_of(view)
    if d not in ("cpu", "cuda"):
        raise Unsupported(f"postrl runs on cpu or cuda, not {d!r}", "trainer.device=cuda")
    if d != v:
        view.note("trainer.device", f"verl's default 'cuda' but no GPU is visible: using {d}")
    return {"trainer.device": d}


def _world(v, view):
    n = world_size(view)
    if device_of(view) == "cpu" or n == 1:
        if n > 1 and (view.is_set("trainer.n_gpus_per_node") or view.is_set("trainer.nnodes")):
            view.note(
                "trainer.n_gpus_per_node",
                f"{n} devices asked for, but on CPU postrl trains in one in-process worker "
                "(trainer.backend=local); data-parallel CPU training is "
                "postrl.trainer.backend=ray postrl.trainer.num_workers=N",
            )
        return {"trainer.backend": "local", "trainer.num_workers": 1}
    return {"trainer.backend": "ray", "trainer.num_workers": n}


_LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard", "file": "jsonl"}


def _logger(v, view):
    items = [v] if isinstance(v, str) else list(v or [])
    out = []
    for name in items:
        if name not in _LOGGERS:
            raise Unsupported(
                f"postrl has no {name!r} metric sink (it has {', '.join(sorted(_LOGGERS))})",
                "trainer.logger=['console','wandb'] or ['console','tensorboard']",
            )
        if name == "wandb" and importlib.util.find_spec("wandb") is None:
            if not view.is_set("trainer.logger"):
                view.note(
                    "trainer.logger",
                    "verl's default includes wandb, which is not installed: logging to the "
                    "console and metrics.jsonl only (pip install 'postrl[wandb]' to add it)",
                )
                continue
            raise Unsupported(
                "wandb is not installed (pip install 'postrl[wandb]')", "trainer.logger=console"
            )
        out.append(_LOGGERS[name])
    if "jsonl" not in out:
        out.append("jsonl")  # postrl always keeps RUN_DIR/metrics.jsonl (plots, exact resume)
    return {"trainer.loggers": out}


def _truncation(v, view):
    if view.get("data.filter_overlong_prompts"):
        return {"data.truncation": "filter"}
    if v == "error":
        return {"data.truncation": "error"}
    raise Unsupported(
        f"postrl does not cut prompts ({v!r}): an over-long prompt is an error or is dropped",
        "data.filter_overlong_prompts=True (drop and count them) or data.truncation=error",
    )


def _resume(v, view):
    if v in ("auto", "disable"):
        return {"trainer.resume_mode": v}
    if v == "resume_path":
        path = view.get("trainer.resume_from_path")
        if not path:
            raise Unsupported(
                "resume_mode=resume_path needs trainer.resume_from_path",
                "trainer.resume_from_path=DIR",
            )
        return {"trainer.resume_mode": _expand(path)}
    raise Unsupported(f"unknown resume_mode {v!r}", "trainer.resume_mode=auto|disable|resume_path")


def _run_dir(v, view):
    if v is None or isinstance(v, _RunDirDefault):
        v = f"checkpoints/{view.get('trainer.project_name')}/{view.get('trainer.experiment_name')}"
    return {"trainer.run_dir": _expand(v)}


class _RunDirDefault(str):
    """verl's ``checkpoints/${trainer.project_name}/${trainer.experiment_name}``."""


def _test_freq(v, view):
    if v is None or v <= 0:
        if view.is_set("trainer.test_freq"):
            view.note(
                "trainer.test_freq",
                f"{v}: postrl validates no more periodically, but still once after the last step",
            )
        return {"trainer.test_freq": 0}
    return {"trainer.test_freq": int(v)}


def _do_sample(v, view):
    if v is False:
        raise Unsupported(
            "greedy training rollouts make every response of a group identical (no signal) "
            "and have no log-probabilities to recompute at temperature 0",
            f"{RO}.temperature=0.3 (low but non-zero)",
        )
    return {}


def _val_temperature(v, view):
    sample = view.get(f"{RO}.val_kwargs.do_sample")
    return {"rollout.val_kwargs.temperature": float(v) if sample else 0.0}


def _val_top_k(v, view):
    if v not in (None, -1, 0):
        raise Unsupported("postrl's validation sampling has no top_k", f"{RO}.val_kwargs.top_p")
    return {}


def _clip_side(side: str):
    """``clip_ratio_low/high``; unset, they follow verl's legacy ``clip_ratio`` when that is set."""

    def conv(v, view):
        if not view.is_set(f"{A}.clip_ratio_{side}") and view.is_set(f"{A}.clip_ratio"):
            v = view.get(f"{A}.clip_ratio")
        return {f"actor.clip_ratio_{side}": float(v)}

    return conv


#: verl's policy-loss hyper-parameters, passed on to the losses whose signature names them.
_LOSS_HPARAMS = {
    f"{A}.policy_loss.clip_cov_ratio": "clip_cov_ratio",
    f"{A}.policy_loss.clip_cov_lb": "clip_cov_lb",
    f"{A}.policy_loss.clip_cov_ub": "clip_cov_ub",
    f"{A}.policy_loss.kl_cov_ratio": "kl_cov_ratio",
    f"{A}.policy_loss.ppo_kl_coef": "ppo_kl_coef",
    f"{A}.policy_loss.dro_beta": "dro_beta",
    f"{A}.tau_pos": "tau_pos",
    f"{A}.tau_neg": "tau_neg",
    f"{A}.loss_scale_factor": "norm_length",
}


_VECTORIZED = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}


def _adv_estimator(v, view):
    from postrl.algos import ADV_ESTIMATORS

    if v in _VECTORIZED:
        view.note("algorithm.adv_estimator", f"{v} is {_VECTORIZED[v]} (postrl's is vectorised)")
        v = _VECTORIZED[v]
    if v not in ADV_ESTIMATORS:
        raise Unsupported(
            f"postrl has no {v!r} estimator",
            "algorithm.adv_estimator=" + "|".join(sorted(ADV_ESTIMATORS.names())),
        )
    return {"algorithm.adv_estimator": v}


def _loss_mode(v, view):
    from postrl.algos import POLICY_LOSSES

    if v not in POLICY_LOSSES:
        raise Unsupported(
            f"postrl has no {v!r} policy loss",
            f"{A}.policy_loss.loss_mode=" + "|".join(sorted(POLICY_LOSSES.names())),
        )
    kwargs: dict[str, Any] = {}
    params = inspect.signature(POLICY_LOSSES.get(v)).parameters
    for vkey, name in _LOSS_HPARAMS.items():
        value = view.get(vkey)
        if name in params and value is not None:
            kwargs[name] = value
        elif view.is_set(vkey):
            view.note(vkey, f"the {v!r} policy loss has no {name!r} hyper-parameter")
    return {"actor.policy_loss": v, "actor.policy_loss_kwargs": kwargs}


def _warmup(prefix: str, to: str):
    def conv(v, view):
        if v is not None and v > 0:
            return {to: int(v)}
        ratio = view.get(f"{prefix}.lr_warmup_steps_ratio") or 0.0
        if ratio <= 0:
            return {to: 0}
        return {to: int(ratio * total_training_steps(view))}

    return conv


def total_training_steps(view: Any) -> int:
    """verl's step count: ``total_training_steps`` or epochs × (train rows // batch size)."""
    steps = view.get("trainer.total_training_steps")
    if steps:
        return int(steps)
    import pyarrow.parquet as pq

    rows = 0
    for f in _files("x")(view.get("data.train_files"), view)["x"]:
        rows += pq.read_metadata(f).num_rows
    return rows // int(view.get("data.train_batch_size")) * int(view.get("trainer.total_epochs"))


def _scheduler(prefix: str, to: str):
    def conv(v, view):
        style = view.get(f"{prefix}.warmup_style")  # verl's older name, used when set
        name = style if style is not None else v
        if name not in ("constant", "cosine"):
            raise Unsupported(
                f"postrl has constant and cosine schedules, not {name!r}",
                f"{prefix}.lr_scheduler_type=cosine",
            )
        return {to: name}

    return conv


def _min_lr(to: str):
    return lambda v, view: {to: float(v or 0.0)}


def _grad_clip(optim_key: str, legacy_key: str, to: str):
    """verl has both ``optim.clip_grad`` and a legacy ``grad_clip``; the one the user set wins."""

    def conv(v, view):
        value = view.get(legacy_key) if view.is_set(legacy_key) else view.get(optim_key)
        return {to: float(value)}

    return conv


def _critic_model_path(v, view):
    actor = view.get(f"{MOD}.path")
    if not v or _expand(v) == _expand(actor) or not view.is_set(f"{C}.model.path"):
        return {"critic.model_path": ""}
    return {"critic.model_path": _expand(v)}


def needs_critic(view: Any) -> bool:
    """The configured advantage estimator needs values (so a critic is built)."""
    from postrl.algos import ADV_ESTIMATORS

    est = view.get("algorithm.adv_estimator")
    return est in ADV_ESTIMATORS and "values" in ADV_ESTIMATORS.meta(est).get("needs", ())


def _critic_enable(v, view):
    est = view.get("algorithm.adv_estimator")
    needs = needs_critic(view)
    if v is False and needs:
        raise Unsupported(
            f"algorithm.adv_estimator={est} needs a critic", "algorithm.adv_estimator=grpo"
        )
    if v is True and not needs:
        view.note(
            f"{C}.enable", f"postrl builds a critic only for estimators that need values, not {est}"
        )
    return {}


def _model_dtype(v, view):
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if not view.is_set(f"{A}.fsdp_config.model_dtype"):
        return {}  # postrl's auto: fp32 master weights, the frozen reference in compute dtype
    if v not in names:
        raise Unsupported(f"postrl stores weights in fp32 or bf16, not {v!r}", "fp32")
    return {"model.dtype": names[v]}


def _compute_dtype(v, view):
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if not view.is_set(f"{A}.fsdp_config.dtype"):
        return {}  # postrl's auto: bfloat16 on GPU, float32 on CPU
    if v not in names:
        raise Unsupported(f"postrl computes in fp32 or bf16, not {v!r}", "bfloat16")
    return {"model.compute_dtype": names[v]}


def _multi_turn(v, view):
    if v:
        return {"rollout.agent.default_agent_loop": "tool_agent"}
    return {}


def _bucket_mb(v, view):
    keys = (f"{RO}.checkpoint_engine.update_weights_bucket_megabytes",
            f"{RO}.update_weights_bucket_megabytes")  # fmt: skip
    for k in keys:
        if view.is_set(k):
            return {"rollout.weight_bucket_mb": float(view.get(k))}
    return {}  # verl's 2 GiB default would only raise the sender's peak memory here


def _sanity_check(v, view):
    if not view.get(f"{RO}.multi_turn.enable"):
        return {}
    return {"rollout.agent.check_token_faithfulness": v != "disable"}


def _agent_loop(v, view):
    names = {"single_turn_agent": "single_turn", "tool_agent": "tool_agent"}
    if view.get(f"{RO}.multi_turn.enable"):
        return {}
    if v in names or v in names.values():
        return {"rollout.agent.default_agent_loop": names.get(v, v)}
    raise Unsupported(
        f"postrl has no agent loop {v!r}", f"{RO}.agent.default_agent_loop=tool_agent"
    )


def _turns(to: str):
    def conv(v, view):
        if v is None:
            return {}  # verl: unlimited; postrl keeps its bound (rollout.agent.max_*_turns)
        return {to: int(v)}

    return conv


def _trainer_mode(v, view):
    names = {"sync": "sync", "colocate_async": "one_step_off", "separate_async": "fully_async"}
    if v not in names:
        raise Unsupported(f"unknown trainer_mode {v!r}", "trainer.v1.trainer_mode=sync")
    return {"trainer.mode": names[v]}


def _async_only(conv):
    """Apply ``conv`` only when verl's trainer mode is asynchronous (postrl's ``sync`` keeps
    staleness 0 whatever the sampler settings say)."""

    def wrapped(v, view):
        if view.get("trainer.v1.trainer_mode") in (None, "sync"):
            return {}
        return conv(v, view)

    return wrapped


def _warmup_batches(v, view):
    """verl counts the batch generated next among its warm-up batches; postrl counts the extra
    ones (``1 + num_warmup_batches`` batches in flight)."""
    if view.get("trainer.v1.trainer_mode") != "colocate_async":
        return {}
    extra = max(int(v or 1) - 1, 0)
    out = {"trainer.async.num_warmup_batches": extra}
    threshold = view.get("trainer.v1.sampler.max_off_policy_threshold")
    if threshold is not None and int(threshold) < 1 + extra:
        raise Unsupported(
            f"num_warmup_batches={v} generates batches {1 + extra} versions ahead but "
            f"trainer.v1.sampler.max_off_policy_threshold={threshold} would drop them",
            f"trainer.v1.sampler.max_off_policy_threshold={1 + extra}",
        )
    return out


_SEPARATE = "trainer.v1.trainer_mode=separate_async"


def _parameter_sync_step(v, view):
    """verl's ``separate_async.parameter_sync_step``: trainer steps between two weight syncs.

    postrl's ``fully_async`` trains one PPO mini-batch per step and pushes weights every
    ``parameter_sync_step`` steps, so ``data.train_batch_size`` (the samples between two pushes)
    must be ``parameter_sync_step × ppo_mini_batch_size``, as verl's own defaults are
    (1024 = 4 × 256). Other combinations are refused, not reinterpreted."""
    if view.get("trainer.v1.trainer_mode") != "separate_async":
        return {}
    key = "trainer.v1.separate_async.parameter_sync_step"
    steps = int(v)
    if steps < 1:
        raise Unsupported(f"{key} must be >= 1", f"{key}=4")
    mini = int(view.get(f"{A}.ppo_mini_batch_size"))
    batch = int(view.get("data.train_batch_size"))
    if batch != steps * mini:
        fixes = [f"data.train_batch_size={steps * mini}"]
        if mini > 0 and batch % mini == 0 and batch >= mini:
            fixes.append(f"{key}={batch // mini}")
        raise Unsupported(
            f"with {_SEPARATE}, postrl trains one {A}.ppo_mini_batch_size={mini} mini-batch "
            f"per step and syncs weights every {steps} steps, so data.train_batch_size={batch} "
            f"must equal parameter_sync_step × ppo_mini_batch_size = {steps * mini}",
            " or ".join(fixes),
        )
    return {"trainer.async.parameter_sync_step": steps}


_parameter_sync_step.why = f"read only with {_SEPARATE}"  # type: ignore[attr-defined]


def _hybrid_rollout(v, view):
    """verl's idle switch (trainer workers generate while they would wait): postrl's
    ``trainer.async.idle_switch=auto`` (switch when the measured wait exceeds the measured
    switch cost)."""
    if view.get("trainer.v1.trainer_mode") != "separate_async":
        return {}
    return {"trainer.async.idle_switch": "auto" if v else "never"}


_hybrid_rollout.why = (  # type: ignore[attr-defined]
    f"read only with {_SEPARATE}: true → auto (the decision from measured wait and switch "
    f"cost), false → never"
)


def _reward_manager(v, view):
    if v in (None, "naive", "prime", "batch", "dapo"):
        if v == "batch":
            return {"reward.custom_function.batch": True}
        return {}
    raise Unsupported(
        f"postrl has no {v!r} reward manager (its reward loop runs per-sample functions in "
        "killable worker processes, or batch functions)",
        "reward_model.reward_manager=naive (or batch for list-in/list-out functions)",
    )


def _custom_fn(field: str, keys: tuple[str, ...]):
    """``custom_reward_function.*`` lives at the top level (older verl) or under ``reward.``."""

    def conv(v, view):
        for k in keys:
            if view.is_set(k):
                value = view.get(k)
                return {f"reward.custom_function.{field}": _expand(value) if value else ""}
        if field == "name":
            return {"reward.custom_function.name": "compute_score"}
        return {"reward.custom_function.path": ""}

    return conv


def _first_set(keys: tuple[str, ...], to: str, cast=None):
    def conv(v, view):
        for k in keys:
            if view.is_set(k) and view.get(k) is not None:
                value = view.get(k)
                return {to: cast(value) if cast else value}
        return {}

    return conv


def _rs_threshold(v, view):
    if v is None:
        return {}
    if isinstance(v, str) and "_" in v:  # "lower_upper"
        lo, hi = v.split("_", 1)
        return {
            "algorithm.rollout_correction.rollout_rs_threshold_lower": float(lo),
            "algorithm.rollout_correction.rollout_rs_threshold": float(hi),
        }
    return {"algorithm.rollout_correction.rollout_rs_threshold": float(v)}


def _val_max(v, view):
    return {"data.max_val_samples": 0 if v is None or v < 0 else int(v)}


def _seed(v, view):
    if v is None:
        return {}
    return {"trainer.seed": int(v)}
