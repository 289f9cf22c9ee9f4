"""``postrl bench step``: one RL step of the reference workload W1, postrl vs the plain way.

W1 (issue 9): the tiny model, briefly SFT-warmed on addition so rewards are not all zero;
16 prompts × 8 samples (GRPO, n=8); up to 16 new tokens at temperature 1.0; one optimizer step
per batch (``actor.ppo_mini_batch_size=16``); no reference model; fp32; 2 threads.

Two ways to do the same step on the same prompts, measured **interleaved in one process** (the
order alternates every step) so background load on a shared machine hits both alike:

- **postrl**: :meth:`RLTrainer.step` (native rollout with shared-prompt prefill, reward loop,
  old log-probs, GRPO advantage, PPO-clip update, weight sync), timed by its own
  ``timing_s/*`` metrics.
- **plain**: ``transformers`` ``model.generate`` (sampling, temperature 1, no top-k/top-p,
  16 new tokens, 128 sequences via ``num_return_sequences=8``, left padding), the same addition
  reward, a group-normalised advantage ``A_i = (r_i - mean_g r) / (std_g r + 1e-6)``, then ONE
  padded forward+backward of ``L = -Σ_t A_i log π(y_t) m_t / Σ m_t`` over the 128 sequences and
  an AdamW step (grad-norm clipped at the same value as postrl). On-policy with one update, the
  PPO ratio is 1 and this is exactly the PPO-clip gradient, so it is the minimum any padded
  trainer does per step; it skips postrl's separate old-log-prob pass and weight sync.

Each side reports the median over ``--steps`` steps after one warm-up step. The two models
start from the same warmed weights and then drift apart (each trains on its own samples), so
response lengths — and the tokens/s — are reported for each side. The native rollout alone
(tokens/s vs ``generate`` on W1-shaped and distinct prompts) is ``postrl bench rollout``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "W1",
    "PlainStep",
    "completion_mask",
    "summarize",
    "prepare_w1",
    "w1_overrides",
    "run_bench",
    "format_report",
    "main",
]

_MAX_PROMPT = 64
_STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "sync_weights", "step")


@dataclass(frozen=True)
class W1:
    """The reference workload's knobs (defaults = W1; tests shrink them)."""

    num_prompts: int = 16
    """Distinct prompts per step (``data.train_batch_size``)."""
    n: int = 8
    """Samples per prompt (GRPO group size, ``rollout.n``)."""
    new_tokens: int = 16
    """Maximum new tokens per sample (``rollout.response_length``)."""
    temperature: float = 1.0
    """Sampling temperature (no top-k / top-p)."""
    threads: int = 2
    """``torch.set_num_threads`` for both sides."""
    lr: float = 1e-5
    """Actor learning rate (both sides; it does not change the cost of a step)."""
    grad_clip: float = 1.0
    """Gradient-norm clip (both sides)."""
    sft_steps: int = 150
    """SFT warm-up steps on addition (lr 3e-3, 2048 tokens per batch)."""
    sft_rows: int = 4000
    """Addition rows generated for the SFT warm-up."""
    train_rows: int = 512
    """Addition prompts in the RL train split."""
    seed: int = 0
    """Seed of the data, the warm-up and the trainer."""


def prepare_w1(work_dir: str | Path, w: W1 = W1()) -> tuple[Path, Path]:
    """Create (or reuse) the SFT-warmed tiny model and the addition RL prompts under ``work_dir``.

    The warmed model is cached: a ``bench_done.json`` marker records the warm-up settings, and a
    rerun with the same settings skips the SFT.

    Returns:
        ``(model_dir, train_parquet)``.
    """
    from postrl.data import generate_addition, sft_rows_from_rl_rows, write_parquet
    from postrl.supervised.sft import run_sft
    from postrl.testing import make_model

    work = Path(work_dir)
    key = {
        "sft_steps": w.sft_steps,
        "sft_rows": w.sft_rows,
        "seed": w.seed,
        "lr": 3e-3,
        "batch_tokens": 2048,
    }
    warm, marker = work / "warm", work / "warm" / "bench_done.json"
    train = work / "data" / f"addition_train_{w.train_rows}_{w.seed}.parquet"
    if not train.exists():
        write_parquet(generate_addition(w.train_rows, seed=w.seed, split="train"), train)
    if marker.exists() and json.loads(marker.read_text()) == key:
        logger.info("reusing warmed model %s", warm)
        return warm, train
    base = make_model(work / "base", preset="tiny", seed=w.seed)
    sft_file = write_parquet(
        sft_rows_from_rl_rows(generate_addition(w.sft_rows, seed=w.seed + 1, split="train")),
        work / "data" / "sft.parquet",
    )
    t0 = time.perf_counter()
    m = run_sft(
        str(base),
        str(sft_file),
        str(warm),
        max_steps=w.sft_steps,
        lr=3e-3,
        batch_tokens=2048,
        seed=w.seed,
        num_threads=w.threads,
        log_every=10**9,
    )
    logger.info(
        "SFT warm-up: %d steps, loss %.3f -> %.3f, %.1f s",
        w.sft_steps,
        m["sft/first_loss"],
        m["sft/final_loss"],
        time.perf_counter() - t0,
    )
    marker.write_text(json.dumps(key))
    return warm, train


def w1_overrides(
    model_dir: str | Path, train_file: str | Path, run_dir: str | Path, w: W1 = W1()
) -> list[str]:
    """``key=value`` overrides that turn the default config into W1 (no validation, no logging)."""
    return [
        f"model.path={model_dir}",
        "model.dtype=float32",
        f"data.train_files=[{train_file}]",
        "data.val_files=[]",
        f"data.train_batch_size={w.num_prompts}",
        f"data.max_prompt_length={_MAX_PROMPT}",
        f"actor.ppo_mini_batch_size={w.num_prompts}",
        f"actor.optim.lr={w.lr}",
        f"actor.optim.grad_clip={w.grad_clip}",
        "ref.enable=false",
        f"rollout.n={w.n}",
        f"rollout.response_length={w.new_tokens}",
        f"rollout.temperature={w.temperature}",
        # KV cache sized for the workload: the defaults (256 slots x the agent-turn length budget)
        # make every wake-up zero ~2.4 GB, several seconds on CPU.
        f"rollout.max_num_seqs={w.num_prompts * w.n}",
        f"rollout.max_model_len={_MAX_PROMPT + w.new_tokens}",
        "algorithm.adv_estimator=grpo",
        f"trainer.num_threads={w.threads}",
        f"trainer.seed={w.seed}",
        "trainer.val_before_train=false",
        "trainer.test_freq=0",
        "trainer.resume_mode=disable",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={run_dir}",
    ]


class PlainStep:
    """The same RL step done the plain way: ``generate`` + one padded forward/backward + AdamW.

    Args:
        model_dir: the HF model directory (loaded fp32 with SDPA attention).
        w: the workload (group size, new tokens, temperature, lr, grad clip).
    """

    def __init__(self, model_dir: str | Path, w: W1) -> None:
        from transformers import AutoModelForCausalLM

        from postrl.data import load_tokenizer

        self.w = w
        self.tok = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=w.lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(w.seed)

    def __call__(self, prompt_ids: list[list[int]], rows: list[dict[str, Any]]) -> dict[str, float]:
        """Run one step on ``prompt_ids`` (one list of token ids per prompt); return timings.

        Returns:
            ``timing_s/{gen,reward,update,step}``, ``completion_tokens``, ``response_length/mean``,
            ``score/mean``.
        """
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        seqs, p_mask, comp, c_mask = self._generate(prompt_ids)
        t["timing_s/gen"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        scores = self._scores(comp, c_mask, rows)
        t["timing_s/reward"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        self._update(seqs, torch.cat([p_mask, c_mask], 1), c_mask, scores)
        t["timing_s/update"] = time.perf_counter() - t2
        t["timing_s/step"] = time.perf_counter() - t0
        tokens = float(c_mask.sum())
        t.update(
            {
                "completion_tokens": tokens,
                "response_length/mean": tokens / len(comp),
                "score/mean": float(scores.mean()),
            }
        )
        return t

    def _generate(self, prompt_ids: list[list[int]]) -> tuple[torch.Tensor, ...]:
        n, pad, eos = self.w.n, self.tok.pad_token_id, self.tok.eos_token_id
        L = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), L), pad, dtype=torch.long)  # (P, L) left-padded
        am = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, L - len(p) :] = torch.tensor(p)
            am[i, L - len(p) :] = 1
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=self.gen)))
        self.model.eval()
        with torch.no_grad():
            seqs = self.model.generate(
                input_ids=ids,
                attention_mask=am,
                do_sample=True,
                temperature=self.w.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=self.w.new_tokens,
                num_return_sequences=n,
                pad_token_id=pad,
                eos_token_id=eos,
            )  # (P*n, L+T), samples of a prompt contiguous
        comp = seqs[:, L:]  # (P*n, T)
        return seqs, am.repeat_interleave(n, 0), comp, completion_mask(comp, eos)

    def _scores(
        self, comp: torch.Tensor, c_mask: torch.Tensor, rows: list[dict[str, Any]]
    ) -> torch.Tensor:
        from postrl.reward import default_compute_score

        out = []
        for i in range(len(comp)):
            r = rows[i // self.w.n]
            text = self.tok.decode(comp[i][c_mask[i].bool()].tolist(), skip_special_tokens=True)
            s = default_compute_score(r["data_source"], text, r["ground_truth"], r["extra_info"])
            out.append(float(s["score"]) if isinstance(s, dict) else float(s))
        return torch.tensor(out)  # (P*n,)

    def _update(
        self, seqs: torch.Tensor, am: torch.Tensor, c_mask: torch.Tensor, scores: torch.Tensor
    ) -> None:
        g = scores.view(-1, self.w.n)  # (P, n)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(
            -1, 1
        )  # (P*n, 1)
        T = c_mask.shape[1]
        pos = (am.cumsum(1) - 1).clamp(min=0)
        self.model.train()
        logits = self.model(input_ids=seqs, attention_mask=am, position_ids=pos).logits[
            :, -T - 1 : -1
        ]  # (P*n, T, V)
        logp = (
            torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, -T:].unsqueeze(-1)).squeeze(-1)
        )  # (P*n, T)
        m = c_mask.float()
        loss = -(adv * logp * m).sum() / m.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.w.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def completion_mask(comp: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 for the tokens up to and including each row's first ``eos_id``, 0 after (the padding
    ``generate`` appends once a row has finished). ``comp``: (B, T) → (B, T) int64."""
    is_eos = (comp == eos_id).long()
    return ((is_eos.cumsum(1) - is_eos) == 0).long()


def _median(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def run_bench(work_dir: str | Path, steps: int = 5, w: W1 = W1()) -> dict[str, Any]:
    """Measure ``steps`` W1 steps each way (after one warm-up step each), interleaved.

    Returns:
        ``{"workload": ..., "postrl": {...}, "plain": {...}, "ratio": {...}, "steps": {...}}``:
        per side the median ``timing_s/*``, completion tokens and tokens/s; ratios are
        plain / postrl (> 1 means postrl is faster).
    """
    from postrl.config import load_config
    from postrl.trainer.trainer import RLTrainer

    if steps < 1:
        raise ValueError(
            f"--steps={steps}: need at least 1 measured step (one warm-up step runs first)"
        )
    torch.set_num_threads(w.threads)
    model_dir, train = prepare_w1(work_dir, w)
    trainer = RLTrainer(
        load_config(None, w1_overrides(model_dir, train, Path(work_dir) / "run", w))
    )
    try:
        trainer.sync_weights()
        plain = PlainStep(model_dir, w)
        ours: list[dict[str, float]] = []
        theirs: list[dict[str, float]] = []
        for step in range(1, steps + 2):  # step 1 = warm-up on both sides
            # the plain side gets the prompts the trainer's mode is about to draw: peek at them
            # and rewind the loader (same state -> same prompts, the exact-resume guarantee)
            state = trainer.loader.state_dict()
            nt = trainer.loader.next_batch().non_tensor_batch
            trainer.loader.load_state_dict(state)
            ids = [list(map(int, p)) for p in nt["raw_prompt_ids"]]
            rows = [
                {
                    "data_source": nt["data_source"][i],
                    "ground_truth": nt["ground_truth"][i],
                    "extra_info": nt["extra_info"][i],
                }
                for i in range(len(ids))
            ]
            order = ("postrl", "plain") if step % 2 else ("plain", "postrl")
            for side in order:
                if side == "postrl":
                    ours.append(trainer.step(step))
                else:
                    theirs.append(plain(ids, rows))
            logger.info(
                "step %d: postrl %.3f s, plain %.3f s",
                step,
                ours[-1]["timing_s/step"],
                theirs[-1]["timing_s/step"],
            )
    finally:
        trainer.close()
    return summarize(ours[1:], theirs[1:], w)


def summarize(
    ours: list[dict[str, float]], theirs: list[dict[str, float]], w: W1
) -> dict[str, Any]:
    """Medians per side and the plain/postrl ratios from raw step rows.

    Ratios: ``step``, ``gen``, ``update`` (vs ``update_actor``), ``train`` (vs
    ``old_log_prob + update_actor``) from medians, and ``step_best`` from each side's fastest step.
    """
    p = {s: _median(ours, f"timing_s/{s}") for s in _STAGES}
    p["train"] = _median(
        [{"x": r["timing_s/old_log_prob"] + r["timing_s/update_actor"]} for r in ours], "x"
    )
    p["completion_tokens"] = _median(ours, "perf/completion_tokens")
    p["completion_tokens_per_s"] = _median(
        [{"x": r["perf/completion_tokens"] / r["timing_s/step"]} for r in ours], "x"
    )
    p["gen_tokens_per_s"] = _median(
        [{"x": r["perf/completion_tokens"] / r["timing_s/gen"]} for r in ours], "x"
    )
    p["response_length/mean"] = _median(ours, "response_length/mean")
    p["score/mean"] = _median(ours, "critic/score/mean")
    q = {s: _median(theirs, f"timing_s/{s}") for s in ("gen", "reward", "update", "step")}
    q["completion_tokens"] = _median(theirs, "completion_tokens")
    q["completion_tokens_per_s"] = _median(
        [{"x": r["completion_tokens"] / r["timing_s/step"]} for r in theirs], "x"
    )
    q["gen_tokens_per_s"] = _median(
        [{"x": r["completion_tokens"] / r["timing_s/gen"]} for r in theirs], "x"
    )
    q["response_length/mean"] = _median(theirs, "response_length/mean")
    q["score/mean"] = _median(theirs, "score/mean")
    ratio = {
        "step": q["step"] / p["step"],
        "gen": q["gen"] / p["gen"],
        "update": q["update"] / p["update_actor"],
        "train": q["update"] / p["train"],
        "step_best": min(r["timing_s/step"] for r in theirs)
        / min(r["timing_s/step"] for r in ours),
    }
    raw = {
        "postrl": [r["timing_s/step"] for r in ours],
        "plain": [r["timing_s/step"] for r in theirs],
    }
    return {"workload": asdict(w), "postrl": p, "plain": q, "ratio": ratio, "steps": raw}


def format_report(res: dict[str, Any]) -> str:
    """The human-readable table printed by ``postrl bench step``."""
    w, p, q, r = res["workload"], res["postrl"], res["plain"], res["ratio"]
    n = len(res["steps"]["postrl"])
    lines = [
        f"W1 step: {w['num_prompts']} prompts x {w['n']} samples, <= {w['new_tokens']} new tokens, "
        f"T={w['temperature']}, fp32, {w['threads']} threads; "
        f"median of {n} step(s) after 1 warm-up",
        "",
        f"postrl  {p['step']:.3f} s/step   {p['completion_tokens_per_s']:.0f} completion tok/s   "
        f"(mean response {p['response_length/mean']:.1f} tok, score {p['score/mean']:.2f})",
    ]
    lines += [f"  {s:<13}{p[s]:.3f} s" for s in _STAGES[:-1]]
    lines += [
        f"plain   {q['step']:.3f} s/step   {q['completion_tokens_per_s']:.0f} completion tok/s   "
        f"(mean response {q['response_length/mean']:.1f} tok, score {q['score/mean']:.2f})",
        f"  {'generate':<13}{q['gen']:.3f} s",
        f"  {'reward':<13}{q['reward']:.3f} s",
        f"  {'fwd+bwd+adam':<13}{q['update']:.3f} s",
        "",
        f"ratio plain/postrl: step {r['step']:.2f}x   gen {r['gen']:.2f}x   "
        f"update {r['update']:.2f}x (vs update_actor)   "
        f"train {r['train']:.2f}x (vs old_log_prob+update_actor)",
        f"best-of-{n} step ratio {r['step_best']:.2f}x "
        "(less sensitive to bursts of background load)",
        f"per-step s: postrl {[round(x, 3) for x in res['steps']['postrl']]}  "
        f"plain {[round(x, 3) for x in res['steps']['plain']]}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``postrl bench step [--steps N] [--work-dir DIR] [--threads T] [--json OUT]``."""
    ap = argparse.ArgumentParser(prog="postrl bench step", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--steps", type=int, default=5, help="measured steps per side (after 1 warm-up step)"
    )
    ap.add_argument(
        "--work-dir",
        default="runs/bench_step",
        help="caches the warmed model; holds the trainer run dir",
    )
    ap.add_argument("--threads", type=int, default=W1.threads)
    ap.add_argument("--json", default="", help="also write the results as JSON to this path")
    ap.add_argument("--prompts", type=int, default=W1.num_prompts, help="prompts per step (W1: 16)")
    ap.add_argument("--n", type=int, default=W1.n, help="samples per prompt (W1: 8)")
    ap.add_argument("--new-tokens", type=int, default=W1.new_tokens, help="max new tokens (W1: 16)")
    ap.add_argument(
        "--sft-steps", type=int, default=W1.sft_steps, help="SFT warm-up steps (cached per value)"
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    w = W1(
        num_prompts=args.prompts,
        n=args.n,
        new_tokens=args.new_tokens,
        threads=args.threads,
        sft_steps=args.sft_steps,
    )
    res = run_bench(args.work_dir, args.steps, w)
    sys.stdout.write(format_report(res) + "\n")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
