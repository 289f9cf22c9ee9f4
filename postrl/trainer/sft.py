"""Supervised fine-tuning on parquet/jsonl rows, with the RL engine's packed forward.

Rows hold either ``messages`` (chat; the loss covers assistant turns only, including the
template's end-of-turn token) or ``prompt`` + ``response`` (``prompt`` a string or a list of chat
messages; the response becomes the assistant turn). Every row is rendered with the tokenizer's
chat template; the assistant spans are found by rendering each prefix of the conversation, so the
mask is exact for any template whose renderings of prefixes are prefixes of the whole.

Loss (token mean over each optimizer step): ``L = −Σ_t m_t log p(x_t | x_<t) / Σ_t m_t`` with
``m`` the assistant mask. Each step packs up to ``batch_tokens`` tokens (rows shuffled per epoch,
seeded); the forward is padding-free (:mod:`postrl.engine.logprob`).

Entry points: :func:`run_sft` (library) and :func:`sft_main` (``postrl sft [CONFIG.yaml]
[key=value ...]`` with the keys of :class:`SFTConfig`).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from postrl.engine.checkpoint import save_hf
from postrl.engine.logprob import policy_logprobs
from postrl.engine.model import load_policy
from postrl.engine.optim import build_optimizer

logger = logging.getLogger(__name__)

__all__ = [
    "SFTConfig",
    "TrainFileOptions",
    "tokenize_rows",
    "run_sft",
    "sft_main",
    "parse_options",
    "warmup_cosine",
]


@dataclass
class TrainFileOptions:
    """Options shared by ``postrl sft`` and ``postrl rm`` (supervised runs over one data file)."""

    model_path: str = ""
    """HF model directory to start from."""
    train_file: str = ""
    """Parquet or jsonl rows."""
    out_dir: str = ""
    """Where the trained HF model (and a metrics JSON) is written."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = run all epochs)."""
    lr: float = 1e-4
    """Peak AdamW learning rate (linear warmup, then cosine to 10%)."""
    warmup_steps: int = 10
    """Linear warmup steps."""
    seed: int = 0
    """Shuffling and init seed."""
    num_threads: int = 0
    """torch threads (0 = leave the default)."""
    log_every: int = 20
    """Log the loss every this many steps."""


@dataclass
class SFTConfig(TrainFileOptions):
    """Options of ``postrl sft`` (also the keyword arguments of :func:`run_sft`); ``train_file``
    rows hold ``messages`` or ``prompt`` + ``response``."""

    weight_decay: float = 0.0
    """AdamW weight decay."""
    batch_tokens: int = 2048
    """Tokens per optimizer step (packed)."""
    max_length: int = 512
    """Rows longer than this are truncated (and the tail's loss dropped)."""
    lora_rank: int = 0
    """LoRA rank (0 = full fine-tuning)."""


def warmup_cosine(total: int, warmup: int) -> Callable[[int], float]:
    """LR factor of step ``s``: linear warmup over ``warmup`` steps, then cosine from 1 to 0.1 at ``total``."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        prog = min(1.0, (s - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog))

    return factor


def _messages(row: dict[str, Any]) -> list[dict[str, str]]:
    if row.get("messages") is not None:
        return list(row["messages"])
    if "prompt" in row and "response" in row:
        prompt = row["prompt"]
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return [*msgs, {"role": "assistant", "content": str(row["response"])}]
    raise ValueError(f"SFT row needs 'messages' or 'prompt'+'response', got keys {sorted(row)}")


def _render(tok, msgs, gen_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen_prompt)
    return tok(text, add_special_tokens=False)["input_ids"]


def tokenize_rows(
    tok, rows: list[dict[str, Any]], max_length: int
) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` per row; mask 1 on assistant tokens (incl. end-of-turn)."""
    out = []
    for row in rows:
        msgs = _messages(row)
        ids = _render(tok, msgs, False)
        mask = [0] * len(ids)
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            start = len(_render(tok, msgs[:i], True)) if i else 0
            end = len(_render(tok, msgs[: i + 1], False))
            if end > len(ids) or ids[:end] != _render(tok, msgs[: i + 1], False):
                raise ValueError(
                    "chat template renders prefixes inconsistently; cannot mask assistant turns"
                )
            mask[start:end] = [1] * (end - start)
        if sum(mask[1:max_length]) > 0:
            out.append((ids[:max_length], mask[:max_length]))
    return out


def _batches(n_tok: list[int], budget: int, rng: random.Random) -> list[list[int]]:
    order = list(range(len(n_tok)))
    rng.shuffle(order)
    out, cur, used = [], [], 0
    for i in order:
        if cur and used + n_tok[i] > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n_tok[i]
    if cur:
        out.append(cur)
    return out


def _tensors(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (B, T) ids/attention and (B, T-1) loss mask; the 'prompt' is the first token."""
    t = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    am = torch.zeros((len(examples), t), dtype=torch.long)
    lm = torch.zeros((len(examples), t), dtype=torch.float32)
    for i, (x, m) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        am[i, : len(x)] = 1
        lm[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, am, lm[:, 1:]


def run_sft(model_path: str, train_file: str, out_dir: str, **options: Any) -> dict[str, float]:
    """Fine-tune ``model_path`` on ``train_file`` and write the HF model to ``out_dir``.

    Args:
        options: any field of :class:`SFTConfig` (epochs, lr, batch_tokens, max_length, seed, ...).

    Returns:
        metrics: ``sft/first_loss``, ``sft/final_loss`` (mean of the last 10 steps),
        ``sft/steps``, ``sft/tokens_per_s``, ``sft/wall_s``.
    """
    from transformers import AutoTokenizer

    from postrl.config.schema import ModelConfig, OptimConfig
    from postrl.data.tasks import read_rows

    cfg = SFTConfig(model_path=model_path, train_file=train_file, out_dir=out_dir, **options)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    data = tokenize_rows(tok, read_rows(cfg.train_file), cfg.max_length)
    if not data:
        raise ValueError(
            f"{cfg.train_file}: no row with assistant tokens within max_length={cfg.max_length}"
        )
    policy = load_policy(ModelConfig(path=cfg.model_path, lora_rank=cfg.lora_rank))
    params = list(policy.trainable_parameters())
    opt = build_optimizer(
        params, OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay)
    )  # fused AdamW on CPU
    rng = random.Random(cfg.seed)
    epochs = [_batches([len(x) for x, _ in data], cfg.batch_tokens, rng) for _ in range(cfg.epochs)]
    total = (
        sum(len(e) for e in epochs)
        if not cfg.max_steps
        else min(cfg.max_steps, sum(len(e) for e in epochs))
    )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(total, cfg.warmup_steps))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    losses: list[torch.Tensor] = []
    n_tokens, t0 = 0, time.perf_counter()
    policy.module.train()
    for batch in (b for e in epochs for b in e):
        if len(losses) >= total:
            break
        ids, am, mask = _tensors([data[i] for i in batch], pad)
        lp, _ = policy_logprobs(policy.decoder, policy.lm_head, ids, am, ids.shape[1] - 1)
        loss = -(lp * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        n_tokens += int(am.sum())
        if cfg.log_every and len(losses) % cfg.log_every == 0:
            logger.info("sft step %d/%d loss %.4f", len(losses), total, float(losses[-1]))
    wall = time.perf_counter() - t0
    hist = torch.stack(losses)
    metrics = {
        "sft/first_loss": float(hist[0]),
        "sft/final_loss": float(hist[-10:].mean()),
        "sft/steps": float(len(losses)),
        "sft/tokens_per_s": n_tokens / max(wall, 1e-9),
        "sft/wall_s": wall,
    }
    out = save_hf(policy, cfg.model_path, cfg.out_dir)
    (out / "sft_metrics.json").write_text(
        json.dumps({**metrics, "config": asdict(cfg)}, indent=1, default=str)
    )
    return metrics


def _coerce(cls: type, cmd: str, name: str, value: str) -> Any:
    typ = {f.name: f.type for f in fields(cls)}.get(name)
    if typ is None:
        raise SystemExit(
            f"unknown {cmd} option {name!r}; choose from {[f.name for f in fields(cls)]}"
        )
    return {"int": int, "float": float}.get(str(typ), str)(value)


def parse_options(argv: list[str], cls: type, cmd: str, example: str) -> dict[str, Any]:
    """``[CONFIG.yaml] [key=value ...]`` → options of the dataclass ``cls`` (a YAML file may nest
    them under ``cmd:``); ``model_path``, ``train_file`` and ``out_dir`` are required."""
    opts: dict[str, Any] = {}
    for a in argv:
        if "=" in a:
            k, _, v = a.partition("=")
            opts[k.strip()] = _coerce(cls, cmd, k.strip(), v)
        else:
            import yaml

            loaded = yaml.safe_load(Path(a).read_text()) or {}
            loaded = loaded.get(cmd, loaded)
            for k, v in loaded.items():
                _coerce(cls, cmd, k, str(v))
                opts.setdefault(k, v)
    missing = [k for k in ("model_path", "train_file", "out_dir") if not opts.get(k)]
    if missing:
        raise SystemExit(f"postrl {cmd}: missing {missing}; e.g. {example}")
    return opts


def sft_main(argv: list[str]) -> int:
    """``postrl sft [CONFIG.yaml] [key=value ...]`` with the keys of :class:`SFTConfig`."""
    opts = parse_options(
        argv, SFTConfig, "sft", "model_path=runs/tiny train_file=sft.parquet out_dir=runs/sft"
    )
    m = run_sft(opts.pop("model_path"), opts.pop("train_file"), opts.pop("out_dir"), **opts)
    logger.info("sft done: %s", json.dumps(m))
    return 0
