"""``postrl train`` / ``postrl eval`` entry points."""

from __future__ import annotations

import logging

from postrl.config import ConfigError, load_config

logger = logging.getLogger(__name__)

__all__ = ["train_main", "eval_main"]


def train_main(config_path: str | None, overrides: list[str]) -> int:
    """Load the config, validate it, train; returns a process exit code."""
    from postrl.data.dataset import DatasetError
    from postrl.trainer.trainer import RLTrainer

    try:
        cfg = load_config(config_path, overrides)
        trainer = RLTrainer(cfg)
    except (ConfigError, DatasetError) as e:  # bad config or data: the message names the fix
        logger.error("%s", e)
        return 2
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def eval_main(config_path: str | None, overrides: list[str]) -> int:
    """Validate ``model.path`` on ``data.val_files`` and print the ``val/*`` metrics."""
    from postrl.data.dataset import DatasetError
    from postrl.trainer.trainer import RLTrainer

    try:
        cfg = load_config(config_path, ["trainer.resume_mode=disable", *overrides])
        if not cfg.data.train_files:
            cfg.data.train_files = list(cfg.data.val_files)
        trainer = RLTrainer(cfg)
    except (ConfigError, DatasetError) as e:
        logger.error("%s", e)
        return 2
    try:
        trainer.sync_weights()
        metrics = trainer.validate()
    finally:
        trainer.close()
    for k in sorted(metrics):
        print(f"{k}: {metrics[k]:.4f}")  # noqa: T201 - CLI output
    return 0
