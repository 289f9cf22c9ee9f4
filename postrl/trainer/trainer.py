"""``RLTrainer``: the single-controller driver of PPO/GRPO-family training.

The driver holds the loop; worker groups (actor, optional reference and critic) do the heavy
work; the rollout engine serves token-in/token-out generation to the agent loops. One RL step
(:meth:`RLTrainer.step`) follows DESIGN.md's stages:

    1 rollout → 2 reward → 3 balance → 4 old/ref log-probs → 5 values → 6 advantage
    → 7 update critic/actor → 8 weight sync → 9 bookkeeping

Algorithm variants attach through registries (estimators declare ``needs``; losses are looked
up by name) and modes through hooks (``postrl.trainer.modes``); the step has no algorithm
branches.
"""

from __future__ import annotations

import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from postrl.algos import ADV_ESTIMATORS, AdaptiveKLController, FixedKLController
from postrl.config import PostRLConfig, dump_config, validate_config
from postrl.data import PromptLoader, RLDataset, load_tokenizer
from postrl.protocol import DataProto
from postrl.testing.faults import maybe_kill
from postrl.trainer import stages
from postrl.trainer.checkpoint import find_latest_checkpoint, load_trainer_state, save_checkpoint
from postrl.trainer.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    reduce_metrics,
    timer,
)
from postrl.trainer.modes import TRAINER_MODES
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
        if cfg.trainer.num_threads > 0:
            torch.set_num_threads(cfg.trainer.num_threads)
        seed_everything(cfg.trainer.seed)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")
        _write_run_info(self.run_dir)

        self.tokenizer = load_tokenizer(cfg.model.path)
        d = cfg.data
        self.train_set = RLDataset(
            d.train_files, self.tokenizer, d.max_prompt_length, d.truncation, d.prompt_key
        )
        self.loader = PromptLoader(
            self.train_set, d.train_batch_size, seed=cfg.trainer.seed, shuffle=d.shuffle
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
        self.total_steps = (
            cfg.trainer.total_steps or self.loader.steps_per_epoch * cfg.trainer.total_epochs
        )
        self.global_step = 0

        needs = set(ADV_ESTIMATORS.meta(cfg.algorithm.adv_estimator).get("needs", ()))
        self.use_critic = "values" in needs
        self.use_ref = (
            cfg.ref.enable
            if cfg.ref.enable is not None
            else (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        )
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            AdaptiveKLController(kc.kl_coef, kc.target_kl, kc.horizon)
            if kc.type == "adaptive"
            else FixedKLController(kc.kl_coef)
        )

        from postrl.trainer.roles import build_roles

        loops = {
            r.get("agent_name") or cfg.rollout.agent.default_agent_loop
            for ds in (self.train_set, self.val_set)
            if ds is not None
            for r in ds.rows
        }
        self.roles = build_roles(
            cfg,
            self.total_steps,
            use_ref=self.use_ref,
            use_critic=self.use_critic,
            multi_turn=loops != {"single_turn"},
        )
        self.rollout = self.roles.rollout
        self.agent_manager = self.roles.agent_manager
        self.reward_loop = self.roles.reward_loop
        self.mode = TRAINER_MODES.get(cfg.trainer.mode)(self)
        self.tracker: Any = None

    # ------------------------------------------------------------------ sampling
    def sampling_params(self, validation: bool = False) -> Any:
        """Rollout sampling parameters (validation uses ``rollout.val_kwargs``)."""
        from postrl.rollout import SamplingParams

        r = self.cfg.rollout
        stop_ids = tuple(t for t in (self.tokenizer.eos_token_id,) if t is not None)
        if validation:
            v = r.val_kwargs
            return SamplingParams(
                temperature=v.temperature,
                top_p=v.top_p,
                max_new_tokens=r.response_length,
                stop_token_ids=stop_ids,
            )
        return SamplingParams(
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.response_length,
            stop_token_ids=stop_ids,
        )

    # ------------------------------------------------------------------ the step
    def step(self, prompts: DataProto, step: int) -> dict[str, float]:
        """One RL step on a batch of prompts; returns the step's metrics (floats)."""
        cfg, t = self.cfg, {}
        m: dict[str, Any] = {}
        futures: dict[int, Any] = {}
        t_step = time.perf_counter()

        rm_cfg = cfg.reward.model
        rm_only = rm_cfg.enable and rm_cfg.mode == "replace"  # no rule functions at all

        def on_sample_end(
            i: int, out: Any, row: dict[str, Any]
        ) -> None:  # 2a: score while the tail runs
            if not rm_only and self.reward_loop.can_stream(row["data_source"]):
                futures[i] = self.reward_loop.submit(
                    stages.make_reward_request(self.tokenizer, out.response_ids, row)
                )

        with timer("gen", t):  # 1. rollout
            batch = self.mode.rollout(
                prompts, self.sampling_params(), cfg.rollout.n, step, on_sample_end
            )
        maybe_kill(f"step{step}:after_gen")
        with timer("reward", t):  # 2. reward (rule/custom functions and/or the reward model)
            if rm_cfg.enable:
                with timer("reward_model", t):
                    rm_scores, rmm = self.roles.rm_scores(batch)
                rm_scores = rm_scores * rm_cfg.weight
                m.update(rmm)
            if rm_only:
                result = stages.reward_model_result(rm_scores, list(batch.non_tensor_batch["uid"]))
            else:
                result = self.reward_loop.finish(batch, futures, self.tokenizer)
                if rm_cfg.enable:
                    result = stages.reward_model_result(rm_scores, result.uids, rule=result)
            self.reward_loop.check_failures(result)
            batch, rm = stages.apply_reward_result(
                batch, result, cfg.reward.overlong, max_response_length=cfg.rollout.response_length
            )
            m.update(rm)
        if cfg.algorithm.filter_groups.enable:
            batch, dm = stages.dynamic_sampling_stage(batch)
            m.update(dm)
        if cfg.trainer.balance_batch and self.roles.dp_size > 1:  # 3. balance
            batch, bm = self.roles.balance(batch)
            m.update(bm)
        batch.meta_info.update(temperature=cfg.rollout.temperature, global_step=step)
        if (
            self.roles.fuse_old_log_prob
        ):  # 4. old / ref log-probs (fused: computed by the update's forward)
            t["timing_s/old_log_prob"] = 0.0
        else:
            with timer("old_log_prob", t):
                batch = self.roles.old_log_probs(batch, m)
        if self.use_ref:
            with timer("ref", t):
                batch = batch.union(self.roles.ref_log_probs(batch))
        if self.use_critic:  # 5. values
            with timer("values", t):
                batch = batch.union(self.roles.values(batch))
        with timer("adv", t):  # 6. advantage
            if cfg.algorithm.use_kl_in_reward:
                batch, km = stages.kl_in_reward_stage(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                m.update(km)
            batch, cm = stages.rollout_correction_stage(batch, cfg.algorithm.rollout_correction)
            m.update(cm)
            batch = stages.compute_advantage_stage(batch, cfg.algorithm)
        if self.use_critic:  # 7. update
            with timer("update_critic", t):
                m.update(self.roles.update_critic(batch))
        with timer("update_actor", t):
            m.update(self.roles.update_actor(batch))
        if (
            self.roles.fused_old_log_probs is not None
        ):  # rollout-vs-train mismatch metrics, after the fact
            batch = batch.union(
                DataProto.from_dict({"old_log_probs": self.roles.fused_old_log_probs})
            )
            m.update(stages.rollout_correction_stage(batch, cfg.algorithm.rollout_correction)[1])
        with timer("sync_weights", t):  # 8. weight sync
            m.update(self.mode.sync_weights())
        m.update(compute_data_metrics(batch, cfg.rollout.response_length))  # 9. bookkeeping
        m.update(_agent_metrics(batch))
        t["timing_s/step"] = time.perf_counter() - t_step
        m.update(t)
        m.update(compute_throughput_metrics(batch, t["timing_s/step"], self.roles.dp_size))
        return reduce_metrics(m)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train for ``total_steps`` (resuming if configured); returns the last step's metrics."""
        from postrl.tracking import Tracker, make_plots, summarize

        start = self._maybe_resume()
        self.push_weights_to_rollout()  # the rollout always starts from the actor's weights
        tc = self.cfg.trainer
        self.tracker = Tracker(
            self.run_dir, tc.loggers, self.total_steps, self.cfg, start_step=start + 1
        )
        last: dict[str, float] = {}
        try:
            if start == 0 and tc.val_before_train and self.val_set is not None:
                self.tracker.log(self.validate(), 0)
            for step in range(start + 1, self.total_steps + 1):
                self.global_step = step
                prompts = self.loader.next_batch()
                metrics = self.step(prompts, step)
                metrics["training/epoch"] = float(prompts.meta_info.get("epoch", 0))
                is_last = step == self.total_steps
                if self.val_set is not None and (
                    (tc.test_freq and step % tc.test_freq == 0) or is_last
                ):
                    with timer("testing", metrics):
                        metrics.update(self.validate())
                self.mode.on_step_end(step, metrics)
                self.tracker.log(metrics, step)
                if tc.save_freq and (step % tc.save_freq == 0 or is_last):
                    self.save(step)
                maybe_kill(f"step{step}:end")
                last = metrics
        finally:
            self.tracker.close()
        plots = make_plots(self.run_dir)
        summary = summarize(self.run_dir)
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
        return validate(self, self.val_set)

    # ------------------------------------------------------------------ weights / checkpoints
    def push_weights_to_rollout(self) -> dict[str, float]:
        """Stream the actor's parameters into the rollout engine(s)."""
        t0 = time.perf_counter()
        self.roles.sync_weights()
        return {"timing_s/weight_push": time.perf_counter() - t0}

    def save(self, step: int) -> Path:
        """Atomic checkpoint of actor/critic/optimizers, data position, KL controller and RNG."""
        state = {
            "loader": self.loader.state_dict(),
            "kl_ctrl": {"value": float(self.kl_ctrl.value)},
            "total_steps": self.total_steps,
        }

        def write(tmp: Path) -> None:
            self.roles.save(tmp)
            maybe_kill(f"step{step}:ckpt_components")

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
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.value = state["kl_ctrl"]["value"]
        logger.info("resumed from %s (step %d)", ckpt, state["step"])
        return int(state["step"])

    def close(self) -> None:
        """Release workers, rollout engines and reward processes."""
        self.mode.close()
        self.roles.close()


def _agent_metrics(batch: DataProto) -> dict[str, float]:
    nt = batch.non_tensor_batch
    out: dict[str, float] = {}
    if "num_turns" in nt and len(nt["num_turns"]):
        turns = np.asarray(nt["num_turns"], dtype=np.float64)
        out["agent/num_turns/mean"] = float(turns.mean())
    agg: dict[str, list[float]] = {}
    for d in nt.get("agent_metrics", []):
        for k, v in (d or {}).items():
            agg.setdefault(k, []).append(float(v))
    for k, vals in agg.items():
        out[k if k.startswith("agent/") else f"agent/{k}"] = sum(vals) / len(vals)
    if "finish_reason" in nt:
        reasons = list(nt["finish_reason"])
        out["response/finish_abort_ratio"] = reasons.count("abort") / max(len(reasons), 1)
    return out


def _write_run_info(run_dir: Path) -> None:
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
    }
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=1))
