"""Per-step data metrics with verl's names (see ``docs/metrics.md``).

All reductions run on tensors; values come back as 0-d tensors and are converted to floats once,
at the logging boundary.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from postrl.protocol import DataProto

__all__ = ["compute_data_metrics", "compute_throughput_metrics", "timer", "reduce_metrics"]


def _stats(prefix: str, x: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    if x.numel() == 0:
        return
    x = x.float()
    out[f"{prefix}/mean"] = x.mean()
    out[f"{prefix}/max"] = x.max()
    out[f"{prefix}/min"] = x.min()


def compute_data_metrics(batch: DataProto, max_response_length: int) -> dict[str, torch.Tensor]:
    """Score/reward/advantage/return/value statistics over valid tokens and lengths."""
    b = batch.batch
    out: dict[str, torch.Tensor] = {}
    mask = b["response_mask"].bool()
    valid = (
        b["sample_valid"].bool()
        if "sample_valid" in b
        else torch.ones(mask.shape[0], dtype=torch.bool)
    )
    if "token_level_scores" in b:
        _stats("critic/score", b["token_level_scores"].sum(-1)[valid], out)
    if "token_level_rewards" in b:
        _stats("critic/rewards", b["token_level_rewards"].sum(-1)[valid], out)
    for key, name in (
        ("advantages", "critic/advantages"),
        ("returns", "critic/returns"),
        ("values", "critic/values"),
    ):
        if key in b:
            _stats(name, b[key][mask], out)
    resp_len = b["attention_mask"][:, -mask.shape[1] :].sum(-1).float()
    prompt_len = b["attention_mask"][:, : -mask.shape[1]].sum(-1).float()
    _stats("response_length", resp_len, out)
    out["response_length/clip_ratio"] = (resp_len >= max_response_length).float().mean()
    _stats("prompt_length", prompt_len, out)
    return out


def compute_throughput_metrics(
    batch: DataProto, step_time_s: float, n_workers: int
) -> dict[str, float]:
    """``perf/throughput`` (all tokens / s / worker), ``perf/total_num_tokens``,
    ``perf/time_per_step``."""
    total = int(batch.batch["attention_mask"].sum())
    resp = int(batch.batch["response_mask"].sum())
    return throughput_from_counts(total, resp, step_time_s, n_workers)


def throughput_from_counts(
    total: float, resp: float, step_time_s: float, n_workers: int
) -> dict[str, float]:
    """:func:`compute_throughput_metrics` from the step's token counts (all tokens, policy
    tokens)."""
    return {
        "perf/total_num_tokens": float(total),
        "perf/completion_tokens": float(resp),
        "perf/time_per_step": step_time_s,
        "perf/throughput": total / max(step_time_s, 1e-9) / max(n_workers, 1),
        "perf/completion_tokens_per_s": resp / max(step_time_s, 1e-9),
    }


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Accumulate wall time of the block into ``timings["timing_s/<name>"]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing_s/{name}"
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0


def reduce_metrics(metrics: dict[str, object]) -> dict[str, float]:
    """Lists → mean, tensors → float (the one host sync per step)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (list, tuple)):
            vals = [float(x) for x in v]
            if vals:
                out[k] = sum(vals) / len(vals)
        elif isinstance(v, torch.Tensor):
            out[k] = float(v.float().mean()) if v.numel() else float("nan")
        elif isinstance(v, (int, float)):
            out[k] = float(v)
    return out
