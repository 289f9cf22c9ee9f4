"""What the supervised programs share: their command line and their learning-rate schedule.

``postrl sft`` and ``postrl rm`` read ``[CONFIG.yaml] [key=value ...]`` into their options
dataclass (:class:`~postrl.config.supervised.SFTConfig`,
:class:`~postrl.config.supervised.RMConfig`) with :func:`parse_options`, and step their learning
rate with :func:`warmup_cosine_scheduler`, the engine's one schedule.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from postrl.config.loader import ConfigError, load_options
from postrl.engine.optim import OptimSpec, build_scheduler

__all__ = ["parse_options", "run_command", "warmup_cosine_scheduler"]

logger = logging.getLogger(__name__)


def warmup_cosine_scheduler(
    opt: torch.optim.Optimizer, lr: float, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The engine's schedule for a supervised run: linear warmup over ``warmup_steps``, then
    cosine from ``lr`` to 10% at ``total_steps`` (a run no longer than its warmup stays in it)."""
    kind = "cosine" if total_steps > warmup_steps else "constant"  # constant: all warmup
    spec = OptimSpec(lr=lr, warmup_steps=warmup_steps, lr_scheduler=kind, min_lr_ratio=0.1)
    return build_scheduler(opt, spec, total_steps)


def parse_options(argv: list[str], cls: type, cmd: str) -> Any:
    """``[CONFIG.yaml] [key=value ...]`` → an instance of the options dataclass ``cls`` (a YAML
    file may nest them under ``cmd:``); ``model_path``, ``train_file`` and ``out_dir`` are
    required. Every problem is reported at once (:func:`postrl.config.loader.load_options`)."""
    files = [a for a in argv if "=" not in a]
    if len(files) > 1:
        raise SystemExit(f"postrl {cmd}: one YAML file at most, got {files}")
    return load_options(
        cls,
        files[0] if files else None,
        [a for a in argv if "=" in a],
        section=cmd,
        required=("model_path", "train_file", "out_dir"),
    )


def run_command(
    argv: list[str], cls: type, cmd: str, run: Callable[..., dict[str, float]]
) -> dict[str, float] | None:
    """``postrl CMD [CONFIG.yaml] [key=value ...]``: parse the options into ``cls``, call
    ``run(model_path, train_file, out_dir, **the rest)`` and log its metrics. Returns them, or
    ``None`` after logging the error when the options are invalid (the command exits 2)."""
    try:
        opts = asdict(parse_options(argv, cls, cmd))
    except ConfigError as e:
        logger.error("postrl %s: %s", cmd, e)
        return None
    m = run(opts.pop("model_path"), opts.pop("train_file"), opts.pop("out_dir"), **opts)
    logger.info("%s done: %s", cmd, json.dumps(m))
    return m
