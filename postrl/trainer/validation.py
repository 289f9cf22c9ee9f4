"""Validation: generate on the test split and report accuracy per data source.

Metrics: ``val/<data_source>/acc`` (mean correctness of the first sample; correctness is the
reward's ``acc`` field when it returns one, else ``score > 0``), ``val/<data_source>/pass@k``
(k = ``rollout.val_kwargs.n``; any of the k samples correct), ``val/<data_source>/score``,
``val/acc/mean`` over all rows, ``val/response_length/mean`` and ``val/reward_failed`` (samples
whose reward failed; excluded from accuracies, never counted as wrong).

With a reward model (``reward.model.enable``) every row is also scored by it
(``val/reward_model/score``, the raw score's mean); the rule metrics above then cover the rows
whose ``data_source`` has a reward function, so preference-only data validates on the RM alone.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from postrl.data import RLDataset

__all__ = ["validate"]


def validate(ctx: Any, dataset: RLDataset) -> dict[str, float]:
    """Run validation generation + scoring with a
    :class:`~postrl.trainer.context.TrainerContext`; returns ``val/*`` metrics."""
    cfg = ctx.cfg
    n = max(1, cfg.rollout.val_kwargs.n)
    bs = cfg.data.val_batch_size or len(dataset)
    sampling = ctx.sampling_params(validation=True)
    correct: dict[str, list[list[float]]] = defaultdict(list)
    scores: dict[str, list[float]] = defaultdict(list)
    lengths: list[float] = []
    rm_on = ctx.reward.reward_model is not None
    rm_scores: list[float] = []
    failed = 0
    for start in range(0, len(dataset), bs):
        prompts = dataset.batch(list(range(start, min(start + bs, len(dataset)))))
        # validation seeds live in their own stream (step = -1 - start): never those of training
        batch = ctx.generate(prompts, sampling, n, -1 - start)
        R = batch.batch["responses"].shape[1]
        lengths.extend(batch.batch["attention_mask"][:, -R:].sum(-1).float().tolist())
        ds = batch.non_tensor_batch["data_source"]
        if rm_on:  # the reward model scores every row; rule metrics from rows with a function
            rm_scores.extend(ctx.reward.rm_scores(batch)[0].tolist())
            ruled = [p for p in range(len(prompts)) if ctx.reward.has_function(ds[p * n])]
        else:
            ruled = list(range(len(prompts)))
        if not ruled:
            continue
        rows_ruled = [i for p in ruled for i in range(p * n, (p + 1) * n)]
        result = ctx.reward.rule_scores(
            batch if len(rows_ruled) == len(batch) else batch[rows_ruled]
        )
        acc = _correctness(result)
        for j, p in enumerate(ruled):
            rows = range(j * n, (j + 1) * n)  # positions in result
            valid = [i for i in rows if bool(result.valid[i])]
            failed += n - len(valid)
            if not valid:
                continue
            correct[str(ds[p * n])].append([acc[i] for i in valid])
            scores[str(ds[p * n])].extend(float(result.scores[i]) for i in valid)
    out: dict[str, float] = {}
    all_first: list[float] = []
    for source, per_prompt in correct.items():
        first = [c[0] for c in per_prompt]
        all_first.extend(first)
        out[f"val/{source}/acc"] = float(np.mean(first))
        out[f"val/{source}/pass@{n}"] = float(np.mean([max(c) for c in per_prompt]))
        out[f"val/{source}/score"] = float(np.mean(scores[source]))
    if all_first:
        out["val/acc/mean"] = float(np.mean(all_first))
    out["val/response_length/mean"] = float(np.mean(lengths)) if lengths else 0.0
    out["val/reward_failed"] = float(failed)
    if rm_scores:
        out["val/reward_model/score"] = float(np.mean(rm_scores))
    return out


def _correctness(result: Any) -> list[float]:
    acc = result.extra.get("acc")
    if acc is not None:
        return [float(a) if isinstance(a, (int, float)) else 0.0 for a in acc]
    return (result.scores > 0).to(torch.float32).tolist()
