"""``RLTrainer``: the single-controller driver of PPO/GRPO-family training.

The driver holds the loop; worker groups (:class:`~postrl.trainer.roles.Roles`: actor, optional
reference, critic and reward model) do the heavy work; the rollout fleet serves token-in/
token-out generation to the agent loops. One RL step (:meth:`RLTrainer.step`) follows
DESIGN.md's stages, each in its own module, visited once and in order:

    1 rollout        mode.next_batch                (trainer/modes.py → context.generate)
    2 reward         ctx.reward.finish              (reward/stage.py)
    3 balance        roles.balance                  (trainer/roles.py)
    4 old/ref logp   roles.old_log_probs, ref_log_probs, teacher_log_probs (distillation)
    5 values         roles.values
    6 advantage      stages.advantage_stage         (needs, KL-in-reward, correction, estimator,
                                                     distillation term)
    7 update         roles.update_critic, update_actor
    8 weight sync    mode.sync_weights              (rollout/fleet.py → weights/)
    9 bookkeeping    stages.step_metrics

Algorithm variants attach through registries (estimators declare ``needs``; losses are looked
up by name) and modes through :class:`~postrl.trainer.modes.TrainerMode`; the step has no
algorithm or role branches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from postrl.algos import AdaptiveKLController, FixedKLController
from postrl.config import PostRLConfig, dump_config, validate_config
from postrl.data import PromptLoader, RLDataset, load_tokenizer
from postrl.data.samplers import build_prompt_sampler
from postrl.protocol import DataProto
from postrl.protocol.traffic import DRIVER_TRAFFIC, DriverTraffic
from postrl.trainer import needs, stages
from postrl.trainer.checkpoint import find_latest_checkpoint, load_trainer_state, save_checkpoint
from postrl.trainer.context import build_context
from postrl.trainer.determinism import determinism_info
from postrl.trainer.health import HealthMonitor
from postrl.trainer.hooks import fire
from postrl.trainer.ledger import TrainedLedger, trained_groups
from postrl.trainer.metrics import reduce_metrics, timer
from postrl.trainer.modes import TRAINER_MODES
from postrl.trainer.roles import build_roles
from postrl.trainer.teacher import check_teacher_tokenizer
from postrl.trainer.validation import validate

logger = logging.getLogger(__name__)

__all__ = ["RLTrainer", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (the one seeding entry point)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class RLTrainer:
    """Build every component from a validated config and run training.

    Args:
        cfg: the full :class:`~postrl.config.PostRLConfig` (validated here, before any model
            is loaded).
    """

    def __init__(self, cfg: PostRLConfig) -> None:
        validate_config(cfg)
        self.cfg = cfg
        torch.set_flush_denormal(cfg.trainer.flush_denormal)  # (threads created later inherit)
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")
        _write_run_info(self.run_dir, cfg)

        self.tokenizer = load_tokenizer(cfg.model.path)
        d = cfg.data
        self.train_set = RLDataset(
            d.train_files, self.tokenizer, d.max_prompt_length, d.truncation, d.prompt_key
        )
        self.loader = PromptLoader(
            self.train_set,
            d.train_batch_size,
            seed=cfg.trainer.seed,
            shuffle=d.shuffle,
            sampler=build_prompt_sampler(
                d.sampler, len(self.train_set), cfg.trainer.seed, d.sampler_kwargs
            ),
        )
        self.val_set = (
            RLDataset(
                d.val_files,
                self.tokenizer,
                d.max_prompt_length,
                d.truncation,
                d.prompt_key,
                max_samples=d.max_val_samples,
            )
            if d.val_files
            else None
        )
        # a mode whose steps are mini-batches (fully_async) takes an epoch in more steps
        per_batch = (
            d.train_batch_size // cfg.actor.ppo_mini_batch_size
            if TRAINER_MODES.meta(cfg.trainer.mode).get("minibatch_steps")
            else 1
        )
        self.total_steps = (
            cfg.trainer.total_steps
            or self.loader.steps_per_epoch * cfg.trainer.total_epochs * per_batch
        )
        self.global_step = 0
        self.train_time_s = 0.0  # summed step wall times (trainer.time_budget_s)
        self.trained: list[tuple[str, int]] = []  # (uid, dataset index) of the last step's groups
        self.trained_epochs: dict[str, int] | None = None  # their epochs (replay-buffer batches)
        self.traffic: dict[tuple[str, str], tuple[int, int, int]] = {}
        """The last step's remote traffic through the driver: ``{(direction, channel): (bytes,
        tensor_bytes, messages)}`` (:class:`~postrl.protocol.traffic.DriverTraffic`)."""

        roles_needed = needs.roles_needed(cfg)  # from the declared needs, never by name
        self.use_critic = "critic" in roles_needed
        self.use_ref = (
            cfg.ref.enable
            if cfg.ref.enable is not None
            else (
                cfg.actor.use_kl_loss
                or cfg.algorithm.use_kl_in_reward
                or "reference" in roles_needed
            )
        )
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon)
            if kc.type == "adaptive"
            else FixedKLController(kc.kl_coef)
        )

        loops = {
            r.get("agent_name") or cfg.rollout.agent.default_agent_loop
            for ds in (self.train_set, self.val_set)
            if ds is not None
            for r in ds.rows
        }
        check_teacher_tokenizer(cfg, self.tokenizer)  # before any model is loaded
        self.roles = build_roles(
            cfg,
            self.total_steps,
            use_ref=self.use_ref,
            use_critic=self.use_critic,
            use_teacher="teacher" in roles_needed,
        )
        self.ctx = build_context(
            cfg,
            self.tokenizer,
            self.loader,
            self.roles.actor,
            self.roles.reward_model,
            multi_turn=loops != {"single_turn"},
        )
        self.ctx.total_steps = self.total_steps
        if self.ctx.core_lease is not None:  # replica processes lend their idle cores
            for wg in (self.roles.actor, self.roles.critic):
                if wg is not None:
                    wg.lend_cores(*self.ctx.core_lease)
        self.mode = TRAINER_MODES.get(cfg.trainer.mode)(self.ctx)
        self.health = HealthMonitor(cfg)  # trainer.health.* alerts on the step's metrics
        self.tracker: Any = None

    # ------------------------------------------------------------------ the step
    def step(self, step: int) -> dict[str, float]:
        """One RL step: the mode's next batch through every stage; the step's metrics."""
        cfg, ctx, roles = self.cfg, self.ctx, self.roles
        t: dict[str, float] = {}
        m: dict[str, Any] = {}
        t_step = time.perf_counter()

        def run(name: str | None, fn: Any, batch: DataProto, *args: Any) -> DataProto:
            with timer(name, t) if name else contextlib.nullcontext():
                batch, metrics = fn(batch, *args)
            m.update(metrics)
            return batch

        with timer("gen", t):  # 1. rollout: the mode decides where the batch comes from
            batch, gm = self.mode.next_batch(step)  # (sync owns DAPO's filter and refill)
        m.update(gm)
        fire(f"step{step}:after_gen")
        batch = run("reward", ctx.reward.finish, batch)  # 2. reward
        self.loader.observe(  # the prompt sampler learns each group's success
            batch.non_tensor_batch["index"], batch.non_tensor_batch["uid"], stages.row_scores(batch)
        )
        m.update(self.loader.sampler_metrics())
        batch = run(None, stages.downsample_stage, batch, cfg, step)  # (PODS: a subset trains)
        batch = run(None, roles.balance, batch)  # 3. balance
        batch.meta_info.update(temperature=cfg.rollout.temperature, global_step=step)
        teacher = roles.submit_teacher(batch)  # 4. (distillation: runs beside the passes below)
        batch = run("old_log_prob", roles.old_log_probs, batch)  # 4. old / ref log-probs
        batch = run("ref", roles.ref_log_probs, batch)
        batch = run(None, roles.teacher_log_probs, batch, teacher)  # (timing_s/teacher)
        batch = run("values", roles.values, batch)  # 5. values
        batch = run("adv", stages.advantage_stage, batch, ctx, self.kl_ctrl)  # 6. advantage
        batch = run("update_critic", roles.update_critic, batch)  # 7. update
        batch = run("update_actor", roles.update_actor, batch)
        fire(f"step{step}:after_update")
        with timer("sync_weights", t):  # 8. weight sync
            m.update(self.mode.sync_weights())
        t["timing_s/step"] = time.perf_counter() - t_step  # 9. bookkeeping
        m.update(t)
        m.update(stages.step_metrics(batch, cfg, t["timing_s/step"], roles.dp_size))
        m["training/epoch"] = float(batch.meta_info.get("epoch", 0))
        self.trained = [] if m.get("dynamic_sampling/skipped_update") else trained_groups(batch)
        self.trained_epochs = batch.meta_info.get("group_epochs")
        self.traffic = DRIVER_TRAFFIC.take()  # what crossed the driver since the last step
        m.update(DriverTraffic.metrics(self.traffic))
        return reduce_metrics(m)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train for ``total_steps`` (resuming if configured); returns the last step's metrics.

        The objects alive at the start are kept off the garbage collector for the run
        (``trainer.freeze_gc``, :func:`postrl.protocol.heap.frozen_heap`)."""
        from postrl.protocol.heap import frozen_heap

        with frozen_heap(self.cfg.trainer.freeze_gc):
            return self._fit()

    def _fit(self) -> dict[str, float]:
        from postrl.tracking import Tracker, make_plots, summarize

        start = self._maybe_resume()
        self.sync_weights()  # the rollout always starts from the actor's weights
        tc = self.cfg.trainer
        self.tracker = Tracker(
            self.run_dir, tc.loggers, self.total_steps, self.cfg, start_step=start + 1
        )
        ledger = TrainedLedger(self.run_dir, start_step=start + 1)
        last: dict[str, float] = {}
        marks = sorted(s for s in tc.test_at_s if s > self.train_time_s)
        try:
            if start == 0 and tc.val_before_train and self.val_set is not None:
                self.tracker.log(self.validate(), 0)
            for step in range(start + 1, self.total_steps + 1):
                self.global_step = step
                metrics = self.step(step)
                metrics.update(self.health.check(metrics, step))
                self.train_time_s += metrics["timing_s/step"]
                metrics["perf/train_time_s"] = self.train_time_s
                out_of_time = 0 < tc.time_budget_s <= self.train_time_s
                is_last = step == self.total_steps or out_of_time
                at_mark = bool(marks) and self.train_time_s >= marks[0]
                while marks and self.train_time_s >= marks[0]:
                    marks.pop(0)
                if self.val_set is not None and (
                    (tc.test_freq and step % tc.test_freq == 0) or is_last or at_mark
                ):
                    with timer("testing", metrics):
                        metrics.update(self.validate())
                    DRIVER_TRAFFIC.take()  # validation's traffic is not the next step's
                self.tracker.log(metrics, step)
                ledger.log(step, int(metrics["training/epoch"]), self.trained, self.trained_epochs)
                if tc.save_freq and (step % tc.save_freq == 0 or is_last):
                    self.save(step)
                fire(f"step{step}:end")
                last = metrics
                if out_of_time:
                    logger.info(
                        "trainer.time_budget_s=%g reached after %.1f s of training (step %d)",
                        tc.time_budget_s,
                        self.train_time_s,
                        step,
                    )
                    break
        finally:
            self.tracker.close()
            ledger.close()
        if (self.run_dir / "metrics.jsonl").exists():
            plots, summary = make_plots(self.run_dir), summarize(self.run_dir)
        else:  # plots and the summary read the jsonl logger's file
            plots = []
            summary = f"no metrics.jsonl: trainer.loggers={list(tc.loggers)} has no jsonl"
        (self.run_dir / "summary.txt").write_text(summary + "\n")
        logger.info(
            "done: metrics in %s, plots in %s\n%s",
            self.run_dir / "metrics.jsonl",
            plots[0].parent if plots else "-",
            summary,
        )
        return last

    def validate(self) -> dict[str, float]:
        """Greedy (or n-sample) generation on the validation set → ``val/*`` metrics."""
        assert self.val_set is not None
        return validate(self.ctx, self.val_set)

    # ------------------------------------------------------------------ weights / checkpoints
    def sync_weights(self) -> dict[str, float]:
        """Stream the actor's parameters into the rollout replicas (``weights/*`` metrics)."""
        return self.mode.sync_weights()

    def save(self, step: int) -> Path:
        """Atomic checkpoint of actor/critic/optimizers, the mode's state (data position),
        the KL controller, the health monitor's counters and RNG."""
        state = {
            "mode": self.mode.state_dict(),
            "kl_ctrl": {"value": float(self.kl_ctrl.value)},
            "total_steps": self.total_steps,
            "policy_version": int(self.ctx.fleet.version),
            "health": self.health.state_dict(),
            "train_time_s": self.train_time_s,
        }

        def write(tmp: Path) -> None:
            self.roles.save(tmp)
            fire(f"step{step}:ckpt_components")

        return save_checkpoint(self.run_dir / "checkpoints", step, state, write, keep_last=0)

    def _maybe_resume(self) -> int:
        mode = self.cfg.trainer.resume_mode
        if mode == "disable":
            return 0
        ckpt = (
            find_latest_checkpoint(self.run_dir / "checkpoints") if mode == "auto" else Path(mode)
        )
        if ckpt is None:
            return 0
        state = load_trainer_state(ckpt)
        self.roles.load(ckpt)
        # checkpoints before the mode interface saved the loader at the top level
        self.mode.load_state_dict(state.get("mode") or {"loader": state["loader"]})
        self.kl_ctrl.value = state["kl_ctrl"]["value"]
        self.health.load_state_dict(state.get("health"))  # absent in older checkpoints
        self.train_time_s = float(state.get("train_time_s", 0.0))
        # fit's first push re-creates the checkpoint's policy version (same weights, same number)
        self.ctx.fleet.restore_version(int(state.get("policy_version", 1)) - 1)
        logger.info("resumed from %s (step %d)", ckpt, state["step"])
        return int(state["step"])

    def close(self) -> None:
        """Release the mode, workers, rollout engines and reward processes."""
        self.mode.close()
        self.ctx.close()
        self.roles.close()


def _write_run_info(run_dir: Path, cfg: PostRLConfig) -> None:
    import json
    import platform
    import subprocess

    import postrl

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(postrl.__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    versions = {}
    for mod in ("torch", "transformers", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    info = {
        "postrl": postrl.__version__,
        "git_rev": rev,
        "python": platform.python_version(),
        "versions": versions,
        "pid": os.getpid(),
        "determinism": determinism_info(cfg),  # the reproducibility promise and its caveats
    }
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=1))
