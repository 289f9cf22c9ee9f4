"""Metric sinks (console, JSONL, TensorBoard, W&B), end-of-run plots and summary."""

from postrl.tracking.plots import make_plots, read_metrics, summarize
from postrl.tracking.sinks import HEADLINE_KEYS, METRIC_SINKS, MetricSink, Tracker, register_sink

__all__ = [
    "HEADLINE_KEYS",
    "METRIC_SINKS",
    "MetricSink",
    "Tracker",
    "make_plots",
    "read_metrics",
    "register_sink",
    "summarize",
]
