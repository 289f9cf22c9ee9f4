"""Reward-model training on preference pairs (Bradley–Terry), for ``reward.model.path``.

Rows: ``prompt`` (a string or chat messages), ``chosen`` and ``rejected`` (the preferred and the
dispreferred response, strings). Each side is rendered exactly as the RL-time scorer renders a
trajectory (:func:`postrl.engine.reward_model.render_conversations`: prompt messages + one
assistant message, the RM's chat template) and scored by a one-label sequence classifier
initialised from ``model_path`` (a causal LM such as the SFT policy — its backbone is kept and a
new, randomly initialised score head is added — or an existing reward model).

Loss (Bradley–Terry; Ouyang et al. 2022, eq. 1): ``L = −mean log σ(r(x, y_c) − r(x, y_r))``.
A held-out ``eval_fraction`` of the pairs measures preference accuracy (``r_c > r_r``) before and
after training.

The LR follows the engine's one schedule (linear warmup, cosine to 10%;
:func:`postrl.supervised.common.warmup_cosine_scheduler`). Preference pairs for a numeric task
come from :func:`postrl.data.preference_pairs` (``postrl data addition OUT --pairs``).

Entry points: :func:`run_rm` and :func:`rm_main` (``postrl rm [CONFIG.yaml] [key=value ...]`` with
the keys of :class:`~postrl.config.supervised.RMConfig`, listed in ``docs/config.md``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from postrl.config.supervised import RMConfig
from postrl.data.tasks import read_rows
from postrl.engine.reward_model import render_conversations, sequence_scores
from postrl.supervised.common import run_command, warmup_cosine_scheduler

logger = logging.getLogger(__name__)

__all__ = ["RMConfig", "run_rm", "rm_main"]


def _prompt_messages(prompt: Any) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def _encode(tok, rows: list[dict[str, Any]], max_length: int) -> list[tuple[list[int], list[int]]]:
    msgs = [_prompt_messages(r["prompt"]) for r in rows]
    for i, r in enumerate(rows):
        for k in ("chosen", "rejected"):
            if not isinstance(r.get(k), str):
                raise ValueError(
                    f"preference row {i}: field {k!r} must be a string, "
                    f"got {type(r.get(k)).__name__}"
                )
    texts_c = render_conversations(tok, msgs, [r["chosen"] for r in rows])
    texts_r = render_conversations(tok, msgs, [r["rejected"] for r in rows])
    ids_c = tok(texts_c, add_special_tokens=False)["input_ids"]
    ids_r = tok(texts_r, add_special_tokens=False)["input_ids"]
    return [(c[-max_length:], r[-max_length:]) for c, r in zip(ids_c, ids_r, strict=True)]


def _margins(model, pairs: list[tuple[list[int], list[int]]], pad: int) -> torch.Tensor:
    """r(chosen) − r(rejected) per pair (one forward over both sides)."""
    scores = sequence_scores(model, [c for c, _ in pairs] + [r for _, r in pairs], pad, "cpu")
    return scores[: len(pairs)] - scores[len(pairs) :]


@torch.no_grad()
def _accuracy(model, pairs: list[tuple[list[int], list[int]]], pad: int, batch: int) -> float:
    if not pairs:
        return float("nan")
    model.eval()
    wins = 0.0
    for s in range(0, len(pairs), batch):
        m = _margins(model, pairs[s : s + batch], pad)
        wins += float((m > 0).sum()) + 0.5 * float((m == 0).sum())  # a tie is half a win
    model.train()
    return wins / len(pairs)


def run_rm(model_path: str, train_file: str, out_dir: str, **options: Any) -> dict[str, float]:
    """Train a reward model on preference pairs and write it (HF format) to ``out_dir``.

    Returns:
        metrics: ``rm/first_loss``, ``rm/final_loss`` (mean of the last 10 steps),
        ``rm/eval_acc_before``, ``rm/eval_acc``, ``rm/train_acc`` (last 10 steps), ``rm/steps``,
        ``rm/wall_s``.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = RMConfig(model_path=model_path, train_file=train_file, out_dir=out_dir, **options)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    rows = read_rows(cfg.train_file)
    missing = [k for k in ("prompt", "chosen", "rejected") if rows and k not in rows[0]]
    if missing:
        raise ValueError(
            f"{cfg.train_file}: preference rows need prompt, chosen, rejected; missing {missing} "
            "(write them with `postrl data addition OUT --pairs`)"
        )
    pairs = _encode(tok, rows, cfg.max_length)
    rng = random.Random(cfg.seed)
    rng.shuffle(pairs)
    n_eval = int(len(pairs) * cfg.eval_fraction)
    evals, train = pairs[:n_eval], pairs[n_eval:]
    if not train:
        raise ValueError(
            f"{cfg.train_file}: no training pairs left after holding out "
            f"eval_fraction={cfg.eval_fraction}"
        )
    model = AutoModelForSequenceClassification.from_pretrained(
        cfg.model_path, num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tok.pad_token_id
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train) / cfg.batch_size)
    total = (
        cfg.epochs * steps_per_epoch
        if not cfg.max_steps
        else min(cfg.max_steps, cfg.epochs * steps_per_epoch)
    )

    sched = warmup_cosine_scheduler(opt, cfg.lr, cfg.warmup_steps, total)
    pad = tok.pad_token_id
    acc_before = _accuracy(model, evals, pad, cfg.batch_size)
    losses: list[float] = []
    accs: list[float] = []
    t0 = time.perf_counter()
    while len(losses) < total:
        rng.shuffle(train)
        for s in range(0, len(train), cfg.batch_size):
            if len(losses) >= total:
                break
            margin = _margins(model, train[s : s + cfg.batch_size], pad)
            loss = -F.logsigmoid(margin).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            accs.append(float((margin.detach() > 0).float().mean()))
            if cfg.log_every and len(losses) % cfg.log_every == 0:
                logger.info(
                    "rm step %d/%d loss %.4f acc %.3f", len(losses), total, losses[-1], accs[-1]
                )
    wall = time.perf_counter() - t0
    metrics = {
        "rm/first_loss": losses[0],
        "rm/final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "rm/train_acc": sum(accs[-10:]) / len(accs[-10:]),
        "rm/eval_acc_before": acc_before,
        "rm/eval_acc": _accuracy(model, evals, pad, cfg.batch_size),
        "rm/eval_pairs": float(len(evals)),
        "rm/steps": float(len(losses)),
        "rm/wall_s": wall,
    }
    _save(model, tok, cfg.out_dir)
    (Path(cfg.out_dir) / "rm_metrics.json").write_text(
        json.dumps({**metrics, "config": asdict(cfg)}, indent=1, default=str)
    )
    return metrics


def _save(model, tok, out_dir: str) -> None:
    """Atomic HF save of the reward model and its tokenizer."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def rm_main(argv: list[str]) -> int:
    """``postrl rm [CONFIG.yaml] [key=value ...]`` with the keys of :class:`RMConfig`."""
    m = run_command(argv, RMConfig, "rm", run_rm)
    if m is None:
        return 2
    sys.stdout.write(
        f"reward model: eval preference accuracy {m['rm/eval_acc_before']:.3f} -> "
        f"{m['rm/eval_acc']:.3f} ({int(m['rm/eval_pairs'])} held-out pairs), "
        f"loss {m['rm/first_loss']:.3f} -> {m['rm/final_loss']:.3f}\n"
    )
    return 0
