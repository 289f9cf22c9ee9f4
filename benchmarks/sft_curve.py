"""SFT's own curve: supervised learning on the ground-truth sums from the same start, by time.

The bound that the learning benchmark's RL arms are read against (issue 19: "SFT's own curve on
the same model"). Starting from the same model as ``benchmarks/learning.py`` (the shared warmed
``tiny-qwen2-sft`` by default), it continues the model's own warm-up recipe — plain next-token
cross-entropy on "What is A+B?" → the decimal sum and end-of-turn, chat template applied, loss on
the assistant tokens only (:func:`postrl.supervised.sft.tokenize_rows`) — on the same training
parquet, for ``--budget-s`` seconds of training time on ``--threads`` threads, and saves the
model at each ``--marks`` second. Afterwards each saved model is validated with ``postrl eval``
on the same held-out split with the recipe's greedy validation, so the numbers are read exactly
as the RL arms' ``val/acc/mean``::

    python benchmarks/sft_curve.py --lr 1e-3 --budget-s 600 --marks 120 300 600
    python benchmarks/learning.py --report runs/learning/results.json runs/learning/sft/results.json

``--teacher DIR`` trains on a teacher's greedy answers to the training prompts instead of the
ground truth (off-policy distillation, "sequence-level knowledge distillation", Kim & Rush 2016:
the ``sft-teacher`` arm of docs/learning.md's distillation table; results under
``WORK_DIR/sft-teacher``)::

    python benchmarks/sft_curve.py --teacher runs/opd/teacher --budget-s 600 --marks 120 300 600

SFT sees the right answer of every training prompt (RL only its reward), so its curve says how
fast this model *can* move on this task per second of CPU — an upper reference, not a competitor.
Results go to ``WORK_DIR/sft/results.json`` in ``learning.py``'s shape.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _evaluate(model: Path, test: Path, threads: int) -> float:
    """Held-out greedy accuracy of ``model`` (``postrl eval`` with the 3-digit recipe)."""
    cmd = [
        sys.executable,
        "-m",
        "postrl.cli",
        "eval",
        str(ROOT / "examples" / "grpo_addition_3digit.yaml"),
        f"model.path={model}",
        f"data.val_files=[{test}]",
        f"data.train_files=[{test}]",
        f"trainer.num_threads={threads}",
        f"trainer.run_dir={model}-eval",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"postrl eval of {model} failed (exit {proc.returncode})")
    for line in proc.stdout.splitlines():
        if line.startswith("val/acc/mean:"):
            return float(line.split(":")[1])
    raise SystemExit(f"postrl eval of {model} printed no val/acc/mean:\n{proc.stdout[-2000:]}")


def _teacher_answers(teacher: str, tok, prompts: list[list[dict]], threads: int) -> list[str]:
    """The teacher's greedy answer (at most 8 new tokens) to each prompt, in batches of 256."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    tok.padding_side = "left"
    out: list[str] = []
    for i in range(0, len(prompts), 256):
        texts = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
            for p in prompts[i : i + 256]
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(
                **enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
            )
        new = gen[:, enc["input_ids"].shape[1] :]
        out += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
    return out


def main(argv: list[str] | None = None) -> int:
    """Train, save at the marks, validate the saved models; print and write the curve."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT.parent / "shared" / "w1" / "tiny-qwen2-sft"))
    p.add_argument("--work-dir", default="runs/learning")
    p.add_argument("--train-size", type=int, default=20000)
    p.add_argument("--test-size", type=int, default=1000)
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--marks", type=float, nargs="+", default=[120.0, 300.0, 600.0])
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW, constant")
    p.add_argument("--batch", type=int, default=64, help="examples per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--teacher",
        default=None,
        help="train on this model's greedy answers to the training prompts (off-policy "
        "distillation) instead of the ground truth",
    )
    a = p.parse_args(argv)

    import torch
    from learning import _data
    from transformers import AutoTokenizer

    from postrl.data.tasks import read_rows
    from postrl.engine.checkpoint import save_hf
    from postrl.engine.logprob import policy_logprobs
    from postrl.engine.model import ModelSpec, load_policy
    from postrl.engine.optim import OptimSpec, build_optimizer
    from postrl.supervised.sft import tokenize_rows

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    work = Path(a.work_dir)
    train, test = _data(work, a.train_size, a.test_size, a.digits)
    out = work / ("sft-teacher" if a.teacher else "sft")
    tok = AutoTokenizer.from_pretrained(a.model)
    rows = [
        {"prompt": list(r["prompt"]), "response": str(r["reward_model"]["ground_truth"])}
        for r in read_rows(str(train))
    ]
    if a.teacher:  # the teacher's answers replace the ground truth (timed apart from training)
        t0 = time.perf_counter()
        answers = _teacher_answers(a.teacher, tok, [r["prompt"] for r in rows], a.threads)
        right = sum(x == r["response"] for x, r in zip(answers, rows)) / max(len(rows), 1)
        rows = [{**r, "response": x} for r, x in zip(rows, answers)]
        print(
            f"teacher answers: {len(rows)} in {time.perf_counter() - t0:.0f} s, {right:.3f} right"
        )
        tok = AutoTokenizer.from_pretrained(a.model)  # right padding again
    data = tokenize_rows(tok, rows, 64)
    policy = load_policy(ModelSpec(path=a.model))
    params = list(policy.trainable_parameters())
    opt = build_optimizer(params, OptimSpec(lr=a.lr))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    rng = random.Random(a.seed)
    marks = sorted(a.marks)
    saved: list[tuple[float, Path]] = []
    train_s, steps = 0.0, 0
    policy.module.train()
    while train_s < a.budget_s:
        t0 = time.perf_counter()
        batch = [data[i] for i in rng.sample(range(len(data)), a.batch)]
        t = max(len(x) for x, _ in batch)
        ids = torch.full((len(batch), t), pad, dtype=torch.long)
        am = torch.zeros((len(batch), t), dtype=torch.long)
        lm = torch.zeros((len(batch), t), dtype=torch.float32)
        for i, (x, m) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            am[i, : len(x)] = 1
            lm[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        mask = lm[:, 1:]
        lp, _ = policy_logprobs(policy.decoder, policy.lm_head, ids, am, t - 1)
        loss = -(lp * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
        train_s += time.perf_counter() - t0
        while len(saved) < len(marks) and train_s >= marks[len(saved)]:
            path = out / f"at{int(marks[len(saved)])}s"
            save_hf(policy, a.model, str(path))
            saved.append((train_s, path))
            print(f"sft: {train_s:.0f}s, step {steps}, loss {float(loss):.4f} -> {path}")
    curve = [(0.0, _evaluate(Path(a.model), test, a.threads))]
    curve += [(t, _evaluate(path, test, a.threads)) for t, path in saved]
    arm = f"sft-teacher-lr{a.lr:g}" if a.teacher else f"sft-lr{a.lr:g}"
    result = {"curve": curve, "steps": steps, "entropy_last": None, "kept_group_share": None}
    (out / "results.json").write_text(
        json.dumps({"args": vars(a), "runs": {arm: {str(a.seed): result}}}, indent=1)
    )
    print(f"{arm}: {steps} steps; held-out greedy accuracy by training time: {curve}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
