"""Metric sinks (console with progress bar, JSONL, TensorBoard, W&B), plots and a summary.

``Tracker(run_dir, loggers=["console", "jsonl"], total_steps=N)`` fans one ``log(metrics, step)``
call out to every sink. ``RUN_DIR/metrics.jsonl`` always gets one JSON object per step (keys
sorted, floats as Python floats), which makes resumed and uninterrupted runs byte-comparable.
Sinks are registered in ``METRIC_SINKS``; TensorBoard and W&B are imported only when selected.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from postrl.registry import Registry

logger = logging.getLogger(__name__)

__all__ = ["METRIC_SINKS", "MetricSink", "Tracker", "register_sink", "HEADLINE_KEYS"]

T = TypeVar("T")

METRIC_SINKS: Registry[Callable[..., MetricSink]] = Registry("metric sink")

#: Metrics shown on the console progress line (when present).
HEADLINE_KEYS = (
    ("critic/score/mean", "score"),
    ("val/acc/mean", "val_acc"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/entropy", "ent"),
    ("response_length/mean", "len"),
    ("timing_s/step", "s/step"),
)


class MetricSink(Protocol):
    """Receives one flat dict of floats per step."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def register_sink(name: str) -> Callable[[T], T]:
    """Decorator registering a sink factory ``f(run_dir, total_steps, config) -> MetricSink``."""
    return METRIC_SINKS.register(name)


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def truncate_steps(path: Path, start_step: int) -> None:
    """Keep only the rows of the JSON-lines file ``path`` whose ``step`` is below
    ``start_step`` (a resumed run rewrites the steps from there on); no file: nothing to do."""
    if not path.exists():
        return
    keep = [
        ln
        for ln in path.read_text().splitlines()
        if ln.strip() and json.loads(ln)["step"] < start_step
    ]
    path.write_text("".join(ln + "\n" for ln in keep))


@register_sink("jsonl")
class JsonlSink:
    """Appends ``{"step": s, ...metrics}`` lines to ``RUN_DIR/metrics.jsonl``.

    On resume the file is truncated to the rows before the resumed step, so the file always
    holds exactly one row per completed step.
    """

    def __init__(
        self, run_dir: Path, total_steps: int = 0, config: Any = None, start_step: int = 0
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        truncate_steps(self.path, start_step)
        self._fh = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {
            "step": step,
            **{k: (None if not math.isfinite(v) else v) for k, v in sorted(metrics.items())},
        }
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


@register_sink("console")
class ConsoleSink:
    """A live progress line with ETA and the headline metrics (stderr)."""

    def __init__(
        self, run_dir: Path, total_steps: int = 0, config: Any = None, start_step: int = 0
    ) -> None:
        self.total = total_steps
        self.start_time = time.time()
        self.start_step = start_step

    def log(self, metrics: dict[str, float], step: int) -> None:
        done = step - self.start_step
        elapsed = time.time() - self.start_time
        eta = elapsed / max(done, 1) * max(self.total - step, 0)
        width = 20
        frac = step / self.total if self.total else 0.0
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        parts = [f"{short}={metrics[k]:.4g}" for k, short in HEADLINE_KEYS if k in metrics]
        sys.stderr.write(
            f"[{bar}] step {step}/{self.total} eta {eta:5.0f}s  " + " ".join(parts) + "\n"
        )
        sys.stderr.flush()

    def close(self) -> None:
        pass


@register_sink("tensorboard")
class TensorBoardSink:
    """TensorBoard event files under ``RUN_DIR/tensorboard`` (needs ``tensorboard``)."""

    def __init__(
        self, run_dir: Path, total_steps: int = 0, config: Any = None, start_step: int = 0
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "trainer.loggers has 'tensorboard' but it is not installed: "
                "pip install postrl[tensorboard]"
            ) from e
        self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def _config_dict(config: Any) -> dict[str, Any]:
    """The run config as a plain nested dict (dataclasses expanded; anything else: {})."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config) if isinstance(config, dict) else {}


@register_sink("wandb")
class WandbSink:
    """Weights & Biases: one W&B run per run directory, holding the resolved config.

    Needs ``wandb`` (``pip install 'postrl[wandb]'``) and either a login or
    ``WANDB_MODE=offline`` (run files under ``RUN_DIR/wandb``, uploadable with ``wandb sync``).
    The W&B run id is kept in ``RUN_DIR/wandb_run_id``, so a resumed postrl run continues the
    same W&B run. Metric names are postrl's (verl's): ``critic/score/mean``, ``actor/pg_loss``...
    """

    def __init__(
        self, run_dir: Path, total_steps: int = 0, config: Any = None, start_step: int = 0
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "trainer.loggers has 'wandb' but it is not installed: pip install 'postrl[wandb]'"
            ) from e
        tc = getattr(config, "trainer", None)
        id_file = Path(run_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = wandb.init(
            project=getattr(tc, "project_name", "postrl"),
            name=getattr(tc, "experiment_name", None),
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=_config_dict(config),
        )
        id_file.write_text(self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    """Fan-out of metrics to the configured sinks; keeps the history for plots/summary."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: list[str],
        total_steps: int,
        config: Any = None,
        start_step: int = 0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.sinks = [
            METRIC_SINKS.get(name)(self.run_dir, total_steps, config, start_step)
            for name in loggers
        ]
        self.history: list[dict[str, float]] = []
        jsonl = self.run_dir / "metrics.jsonl"
        if jsonl.exists():  # history of the steps before a resume (for plots and summary)
            for ln in jsonl.read_text().splitlines():
                if ln.strip():
                    row = json.loads(ln)
                    if row["step"] < start_step:
                        self.history.append(
                            {k: (math.nan if v is None else v) for k, v in row.items()}
                        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Log one step's metrics (tensors/numbers; non-numeric values are ignored)."""
        clean = _clean(metrics)
        self.history.append({"step": float(step), **clean})
        for s in self.sinks:
            s.log(clean, step)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
