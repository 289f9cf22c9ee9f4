"""Supervised fine-tuning on parquet/jsonl rows, with the RL engine's packed forward.

Rows hold either ``messages`` (chat; the loss covers assistant turns only, including the
template's end-of-turn token) or ``prompt`` + ``response`` (``prompt`` a string or a list of chat
messages; the response becomes the assistant turn). Every row is rendered with the tokenizer's
chat template; the assistant spans are found by rendering each prefix of the conversation, so the
mask is exact for any template whose renderings of prefixes are prefixes of the whole.

Loss (token mean over each optimizer step): ``L = −Σ_t m_t log p(x_t | x_<t) / Σ_t m_t`` with
``m`` the assistant mask. Each step packs up to ``batch_tokens`` tokens (rows shuffled per epoch,
seeded); the forward is padding-free (:mod:`postrl.engine.logprob`); the LR follows the engine's
one schedule (:func:`postrl.engine.optim.build_scheduler`: linear warmup, cosine to 10%).

Entry points: :func:`run_sft` (library) and :func:`sft_main` (``postrl sft [CONFIG.yaml]
[key=value ...]`` with the keys of :class:`~postrl.config.supervised.SFTConfig`, loaded by
:func:`postrl.supervised.common.parse_options`; the keys are listed in ``docs/config.md``).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict
from typing import Any

import torch

from postrl.config.supervised import SFTConfig, TrainFileOptions
from postrl.data.tasks import read_rows
from postrl.engine.checkpoint import save_hf
from postrl.engine.logprob import policy_logprobs
from postrl.engine.model import ModelSpec, load_policy
from postrl.engine.optim import OptimSpec, build_optimizer
from postrl.supervised.common import run_command, warmup_cosine_scheduler

logger = logging.getLogger(__name__)

__all__ = [
    "SFTConfig",
    "TrainFileOptions",
    "tokenize_rows",
    "run_sft",
    "sft_main",
]


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
        ``sft/steps``, ``sft/extra_steps`` (past ``max_steps``, for ``target_loss``),
        ``sft/tokens_per_s``, ``sft/wall_s``.
    """
    from transformers import AutoTokenizer

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
    policy = load_policy(ModelSpec(path=cfg.model_path, lora_rank=cfg.lora_rank))
    params = list(policy.trainable_parameters())
    # fused AdamW on CPU
    opt = build_optimizer(params, OptimSpec(lr=cfg.lr, weight_decay=cfg.weight_decay))
    rng = random.Random(cfg.seed)
    epochs = [_batches([len(x) for x, _ in data], cfg.batch_tokens, rng) for _ in range(cfg.epochs)]
    total = (
        sum(len(e) for e in epochs)
        if not cfg.max_steps
        else min(cfg.max_steps, sum(len(e) for e in epochs))
    )

    sched = warmup_cosine_scheduler(opt, cfg.lr, cfg.warmup_steps, total)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    losses: list[torch.Tensor] = []
    n_tokens, t0 = 0, time.perf_counter()
    policy.module.train()
    target = float(cfg.target_loss)
    for batch in (b for e in epochs for b in e):
        if len(losses) >= total and not (
            target > 0
            and len(losses) < total + cfg.target_extra_steps
            and float(torch.stack(losses[-10:]).mean()) > target
        ):
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
    final = float(hist[-10:].mean())
    if target > 0 and final > target:
        logger.warning(
            "sft: the loss (mean of the last 10 steps) is %.3f after %d steps, above "
            "target_loss=%.3f; raise target_extra_steps or lr",
            final,
            len(losses),
            target,
        )
    metrics = {
        "sft/first_loss": float(hist[0]),
        "sft/final_loss": final,
        "sft/steps": float(len(losses)),
        "sft/extra_steps": float(max(0, len(losses) - total)),
        "sft/tokens_per_s": n_tokens / max(wall, 1e-9),
        "sft/wall_s": wall,
    }
    out = save_hf(policy, cfg.model_path, cfg.out_dir)
    (out / "sft_metrics.json").write_text(
        json.dumps({**metrics, "config": asdict(cfg)}, indent=1, default=str)
    )
    return metrics


def sft_main(argv: list[str]) -> int:
    """``postrl sft [CONFIG.yaml] [key=value ...]`` with the keys of :class:`SFTConfig`."""
    return 2 if run_command(argv, SFTConfig, "sft", run_sft) is None else 0
