"""TRL's GRPOTrainer on an addition task, with the validation schedule of benchmarks/learning.py.

The side-by-side arm of the learning benchmark: the same model directory, the same training and
held-out parquet files (``postrl data addition``), the same reward (postrl's ``addition`` rule,
loaded from its file), the same batch shape (prompts × responses per step), learning rate,
response length and temperature, and held-out **greedy** accuracy measured at the same seconds of
training time (generation + update of the steps, evaluation excluded), so a row of this script
and a row of ``learning.py`` compare like for like. Run it in an environment with ``trl``
(it is not a dependency of postrl)::

    python -m venv /tmp/trlenv && /tmp/trlenv/bin/pip install torch==2.13.0 trl
    OMP_NUM_THREADS=2 /tmp/trlenv/bin/python benchmarks/trl_addition.py \
        --model runs/quickstart/sft-model --train runs/learning-qs/data/train4000-d1.parquet \
        --test runs/learning-qs/data/test500-d1.parquet --budget-s 45 --marks 5 10 15 30 45 \
        --lr 2e-4 --out runs/learning-qs/trl-s0.json --seed 0

The settings mirror postrl's GRPO defaults: group-normalised advantages (``scale_rewards=group``),
token-mean loss over the batch (``loss_type=dapo``), clip 0.2, no KL (``beta=0``), constant
learning rate, AdamW, gradient clipping at 1.0, one optimizer step per batch, fp32 on the CPU.
The JSON it writes has ``learning.py``'s run shape (``curve``: [[train_seconds, accuracy], ...],
``steps``), so ``learning.py --report`` can merge it into one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _reward_rule():
    """postrl's ``addition`` scoring function, loaded from its file (no postrl install)."""
    path = ROOT / "postrl" / "reward" / "rules" / "addition.py"
    spec = importlib.util.spec_from_file_location("postrl_addition_rule", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod.compute_score


def _rows(path: str) -> list[dict]:
    import pandas as pd

    df = pd.read_parquet(path)
    return [
        {"prompt": [dict(m) for m in p], "ground_truth": str(rm["ground_truth"])}
        for p, rm in zip(df["prompt"], df["reward_model"])
    ]


def addition_reward(score):
    """A TRL reward function over the ``addition`` rule ``score`` (``_reward_rule()``)."""

    def reward(completions, ground_truth, **_):
        return [
            float(score("addition", c[-1]["content"], gt)["score"])
            for c, gt in zip(completions, ground_truth)
        ]

    return reward


def grpo_config(
    output_dir: str, *, seed: int, lr: float, batch: int, n: int, response_length: int,
    max_steps: int,
):  # fmt: skip
    """TRL's ``GRPOConfig`` with postrl's GRPO defaults (module docstring): fp32 on the CPU,
    group-normalised advantages, token-mean loss, clip 0.2, no KL, constant lr, one optimizer
    step per batch of ``batch`` samples (``n`` per prompt)."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=response_length,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=max_steps,
        logging_steps=10_000,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(argv: list[str] | None = None) -> int:
    """Train with TRL for ``--budget-s`` seconds of training time; write the curve as JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True, help="training parquet (postrl data addition)")
    p.add_argument("--test", required=True, help="held-out parquet")
    p.add_argument("--budget-s", type=float, default=45.0)
    p.add_argument("--marks", type=float, nargs="+", default=[5, 10, 15, 30, 45])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--response-length", type=int, default=8)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(a.threads)
    score = _reward_rule()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    train = Dataset.from_list(_rows(a.train))
    test = _rows(a.test)

    def greedy_accuracy() -> float:
        was_training = model.training
        model.eval()
        tok.padding_side = "left"
        correct = 0
        with torch.no_grad():
            for i in range(0, len(test), 128):
                chunk = test[i : i + 128]
                texts = [
                    tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
                    for r in chunk
                ]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(
                    **enc,
                    do_sample=False,
                    max_new_tokens=a.response_length,
                    pad_token_id=tok.pad_token_id,
                )
                for r, ids in zip(chunk, out[:, enc["input_ids"].shape[1] :]):
                    text = tok.decode(ids, skip_special_tokens=True)
                    correct += score("addition", text, r["ground_truth"])["acc"]
        model.train(was_training)
        return correct / len(test)

    marks = sorted(a.marks)
    curve: list[list[float]] = []
    state = {"train_s": 0.0, "t0": 0.0, "next": 0, "steps": 0}

    class Budget(TrainerCallback):
        """Counts the steps' wall time; validates at the marks; stops at the budget."""

        def on_train_begin(self, args, st, control, **kw):
            curve.append([0.0, greedy_accuracy()])

        def on_step_begin(self, args, st, control, **kw):
            state["t0"] = time.perf_counter()

        def on_step_end(self, args, st, control, **kw):
            state["train_s"] += time.perf_counter() - state["t0"]
            state["steps"] += 1
            t = state["train_s"]
            while state["next"] < len(marks) and t >= marks[state["next"]]:
                state["next"] += 1
                curve.append([t, greedy_accuracy()])
                print(f"trl: {t:.1f}s of training, step {state['steps']}: {curve[-1][1]:.3f}")
            if t >= a.budget_s:
                control.should_training_stop = True

    cfg = grpo_config(
        str(Path(a.out).with_suffix("")) + "-trl-out",
        seed=a.seed,
        lr=a.lr,
        batch=a.prompts * a.n,
        n=a.n,
        response_length=a.response_length,
        max_steps=1_000_000,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=addition_reward(score),
        args=cfg,
        train_dataset=train,
        processing_class=tok,
        callbacks=[Budget()],
    )
    trainer.train()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"curve": curve, "steps": state["steps"]}))
    print(f"trl: {state['steps']} steps, curve {curve}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
