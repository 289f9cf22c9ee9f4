"""Which levers turn speed into learning? Held-out accuracy on 3-digit addition by training time.

Every arm starts from the shared warmed model (``../shared/w1/tiny-qwen2-sft``, 5.5 % greedy on
3-digit sums) and trains for ``--budget-s`` seconds of training time (``trainer.time_budget_s``:
the steps' wall times summed, validation excluded) on ``--threads`` threads. Held-out greedy
accuracy (1000 problems of the disjoint test split) is measured at each ``--marks`` second
(``trainer.test_at_s``). Arms run one after another, seed-major (arm 1 seed 0, arm 2 seed 0, ...,
arm 1 seed 1, ...), each in a fresh process, and the table gives the mean over seeds at each mark.

The arms (``--arms``; each is ``examples/grpo_addition_3digit.yaml`` plus overrides):

* ``w1``: the W1 shape, the issue's baseline (16 prompts × 8, lr 1e-4, plain GRPO);
* ``dapo``: + dynamic sampling with exact refill (``algorithm.filter_groups``);
* ``pods``: 32 responses generated per prompt, the max-variance 8 trained
  (``algorithm.downsample``);
* ``difficulty``: + replay of prompts in the learnable band (``data.sampler=difficulty``);
* ``partial``: + digit-level partial credit in the reward (``reward.reward_kwargs``);
* ``reuse``: 4 PPO epochs per batch (``actor.ppo_epochs``);
* ``lr2e-4``, ``lr3e-4``, ``entropy``: larger steps (the last with an entropy bonus);
* ``psr``: negative advantages at half weight (``algorithm.adv_estimator_kwargs``);
* ``mini8``: two optimizer steps per batch (``actor.ppo_mini_batch_size=8``);
* ``batch8``: 8 prompts per step (twice the steps per second);
* ``dapo-lr3e-4``: dynamic sampling at lr 3e-4 (collapses);
* ``psr0``: dynamic sampling with positive-sample reinforcement only (``negative_weight: 0``),
  lr 1e-4; ``psr0-lr3e-4-nofilter``: PSR at lr 3e-4 without dynamic sampling;
* ``dapo-n16``: ``dapo`` with 16 responses per prompt (larger groups);
* ``recipe``: the shipped recipe as it is (dynamic sampling + PSR at lr 3e-4, an adaptive
  entropy bonus, replay of band prompts, 32 prompts × 8 per update); ``recipe-b16``: the same
  with 16 prompts per update (the recipe until 2026-12-07; every other ``recipe-*`` arm
  keeps the 16 it was measured with);
  ``recipe-cosine``: its step size decayed by a cosine to 10 % over 950 optimizer steps;
  ``recipe-greso``: with selective rollout (``data.sampler=greso``: prompts uninformative on
  their last visits mostly skipped before generation);
* ``opd``: on-policy distillation from ``--teacher`` (``examples/opd_addition_3digit.yaml``:
  the per-token reverse KL to the teacher is the advantage, no task reward); ``opd-mixed``: the
  same plus the task reward's GRPO advantages (``distill.task_reward_weight=1``); ``opd-gkd``:
  GKD's generalised JSD(0.5) over the teacher's top-32 tokens (+ tail) as a term of the update's
  loss instead (``distill.loss=gkd``), no task reward.

``--task quickstart`` runs the quickstart's task instead: 1-digit sums from the quickstart's SFT
model (``runs/quickstart/sft-model``, built by ``make quickstart``), ``examples/grpo_addition.yaml``
plus the ``qs*`` arms (greedy validation on a disjoint test split): ``qs`` (as it ships),
``qs-dapo`` (+ dynamic sampling), ``qs-lr4e-4``, ``qs-dapo-lr4e-4``, ``qs-batch8``, and the
3-digit recipe's levers: ``qs-psr`` (positive-sample reinforcement), ``qs-psr-lr6e-4``,
``qs-dapo-psr-lr6e-4``::

    python benchmarks/learning.py --task quickstart --arms qs qs-dapo --budget-s 45 \
        --marks 5 10 15 30 45 --test-size 500 --train-size 4000 --work-dir runs/learning-qs

    python benchmarks/learning.py --arms w1 recipe --seeds 0 1              # 2 × 2 × 10 min
    python benchmarks/learning.py --budget-s 120 --marks 60 120 --seeds 0   # a 2-minute screen

Data is written under ``--work-dir`` if missing (``postrl data addition --max-digits 3``).
Results go to ``WORK_DIR/results.json`` and the curves to ``WORK_DIR/learning.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "w1" / "tiny-qwen2-sft"
RECIPE = ROOT / "examples" / "grpo_addition_3digit.yaml"

SEQ = ["data.sampler=sequential", "data.sampler_kwargs={}"]  # the permutation, no replays
# 16 prompts per update: the recipe until 2026-12-07 (every arm measured before then has it)
B16 = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16"]
# the W1 shape on top of the recipe file: every lever of the recipe switched off
W1 = [
    *B16,
    "rollout.n=8",
    "actor.optim.lr=1e-4",
    "actor.ppo_epochs=1",
    "actor.entropy_coeff=0",
    "actor.entropy_target=0",
    "algorithm.filter_groups.enable=false",
    "algorithm.downsample.enable=false",
    *SEQ,
    "reward.reward_kwargs={}",
    "algorithm.adv_estimator_kwargs={}",
]

DAPO = "algorithm.filter_groups.enable=true"  # dynamic sampling, exact refill
PSR0 = "algorithm.adv_estimator_kwargs={negative_weight: 0}"  # positive-sample reinforcement
# on-policy distillation (issue 36): the teacher (``--teacher``, built by
# examples/opd_addition_3digit.sh) scores every token the student samples; the per-token reverse
# KL, centred on the batch mean, is the advantage (distill.loss=reverse_kl, distill.baseline=
# mean), or GKD's JSD(0.5) is a term of the loss (opd-gkd, examples/opd_addition_3digit.yaml).
# lr 3e-4 (docs/learning.md: the plain reverse KL at 1e-4 gained 2 points in 10 minutes, at
# 1e-3 it diverged).
TEACHER = "@TEACHER@"  # replaced by --teacher
OPD = [
    *B16,
    "algorithm.filter_groups.enable=false",  # every group carries the teacher's signal
    "algorithm.adv_estimator_kwargs={}",
    "actor.entropy_coeff=0",
    "actor.entropy_target=0",
    "actor.optim.lr=3e-4",
    *SEQ,
    f"distill.teacher_path={TEACHER}",
]
RKL = ["distill.loss=reverse_kl", "distill.baseline=mean"]
ARMS: dict[str, list[str]] = {
    "w1": W1,
    "dapo": [*W1, DAPO],
    "pods": [
        *W1,
        "rollout.n=32",
        "algorithm.downsample.enable=true",
        "algorithm.downsample.size=8",
    ],
    "difficulty": [
        *W1,
        "data.sampler=difficulty",
        "data.sampler_kwargs={replay_fraction: 0.5}",
    ],
    "partial": [*W1, "reward.reward_kwargs={partial_credit: 0.5}"],
    "reuse": [*W1, "actor.ppo_epochs=4"],
    "lr2e-4": [*W1, "actor.optim.lr=2e-4"],
    "lr3e-4": [*W1, "actor.optim.lr=3e-4"],
    "entropy": [*W1, "actor.optim.lr=3e-4", "actor.entropy_coeff=0.01"],
    "psr": [*W1, "algorithm.adv_estimator_kwargs={negative_weight: 0.5}"],
    "mini8": [*W1, "actor.ppo_mini_batch_size=8"],
    "batch8": [*W1, "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"],
    "dapo-lr3e-4": [*W1, DAPO, "actor.optim.lr=3e-4"],
    # positive-sample reinforcement: wrong answers get no push-down (negative_weight 0)
    "psr0": [*W1, DAPO, PSR0],
    "psr0-lr3e-4-nofilter": [*W1, "actor.optim.lr=3e-4", PSR0],
    "recipe": [],
    # the recipe before 2026-12-07: 16 prompts per update instead of 32
    "recipe-b16": [*B16],
    # the recipe before it replayed band prompts (2026-12-06): each prompt once per epoch
    "recipe-seq": [*B16, *SEQ],
    # the recipe with the step size decayed by a cosine to 10 % over ~10 minutes of steps here
    # (~950 optimizer steps on 2 EPYC threads; the schedule counts steps, not seconds)
    "recipe-cosine": [
        *B16,
        *SEQ,
        "actor.entropy_coeff=0",  # (measured before the recipe had its entropy bonus)
        "actor.entropy_target=0",
        "actor.optim.lr_scheduler=cosine",
        "actor.optim.min_lr_ratio=0.1",
        "trainer.total_steps=950",
    ],
    # the recipe's bonus fixed at 0.01 (no controller): the recipe until 2026-12-06
    "recipe-fixedent": [*B16, *SEQ, "actor.entropy_target=0"],
    # the fixed bonus lowered or off: the recipe before 2026-12-03's last runs
    "recipe-ent3e-3": [*B16, *SEQ, "actor.entropy_target=0", "actor.entropy_coeff=0.003"],
    "recipe-ent0": [*B16, *SEQ, "actor.entropy_target=0", "actor.entropy_coeff=0"],
    # adaptive entropy control (Skywork-OR1) from the paper's floor of 0: the early bonus fades
    # while the entropy is above the target (the recipe's controller keeps 0.01 as its floor)
    "recipe-enttarget0": [*B16, *SEQ, "actor.entropy_coeff_min=0"],
    # selective rollout (GRESO) on the recipe: prompts whose last visits were all right or all
    # wrong are mostly skipped before they are generated (the recipe keeps ~23 % of its groups)
    "recipe-greso": [*B16, "data.sampler=greso", "data.sampler_kwargs={}"],
    # the same, all-wrong prompts explored more: up to half the generated groups may be
    # all-wrong before that kind's exploration goes down (the default 0.125 starves them)
    "recipe-greso-hard50": [
        *B16,
        "data.sampler=greso",
        "data.sampler_kwargs={target_hard: 0.5}",
    ],
    # replay of band prompts on the recipe: replayed groups are likely kept, so fewer groups
    # are generated per step (the recipe keeps ~23 % of what it generates)
    "recipe-difficulty": [
        *B16,
        "data.sampler=difficulty",
        "data.sampler_kwargs={replay_fraction: 0.5, max_replays: 2}",
    ],
    # the previous recipe (dynamic sampling, lr 1e-4) with 16 responses per prompt
    "dapo-n16": [*W1, DAPO, "rollout.n=16"],
    # on-policy distillation: pure (the task reward logged, not trained), and mixed with the
    # task reward's GRPO advantages at weight 1
    "opd": [*OPD, *RKL, "distill.task_reward_weight=0"],
    "opd-mixed": [*OPD, *RKL, "distill.task_reward_weight=1"],
    # GKD: generalised JSD(β = 0.5) over the teacher's top-32 (+ tail) in the update's loss
    "opd-gkd": [*OPD, "distill.loss=gkd", "distill.topk=32", "distill.task_reward_weight=0"],
}

# the quickstart task (1-digit sums from the quickstart's SFT model), validated greedily
QUICKSTART = ROOT / "examples" / "grpo_addition.yaml"
# (the example stops at 150 steps; here the time budget does)
QS_GREEDY = [
    "rollout.val_kwargs.temperature=0",
    "rollout.val_kwargs.n=1",
    "trainer.total_steps=1000000",
]
QS_ARMS: dict[str, list[str]] = {
    "qs": QS_GREEDY,  # the quickstart's GRPO settings as they ship
    "qs-dapo": [*QS_GREEDY, DAPO],
    "qs-lr4e-4": [*QS_GREEDY, "actor.optim.lr=4e-4"],
    "qs-dapo-lr4e-4": [*QS_GREEDY, DAPO, "actor.optim.lr=4e-4"],
    "qs-batch8": [*QS_GREEDY, "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"],
    # the 3-digit recipe's levers: positive-sample reinforcement (+ dynamic sampling)
    "qs-psr": [*QS_GREEDY, PSR0],
    "qs-psr-lr6e-4": [*QS_GREEDY, PSR0, "actor.optim.lr=6e-4"],
    "qs-dapo-psr-lr6e-4": [*QS_GREEDY, DAPO, PSR0, "actor.optim.lr=6e-4"],
}
TASKS = {
    # task: (recipe file, default model, max digits, arms)
    "3digit": (RECIPE, MODEL, 3, ARMS),
    "quickstart": (QUICKSTART, ROOT / "runs" / "quickstart" / "sft-model", 1, QS_ARMS),
}


def _data(work: Path, n_train: int, n_test: int, digits: int = 3) -> tuple[Path, Path]:
    train = work / "data" / f"train{n_train}-d{digits}.parquet"
    test = work / "data" / f"test{n_test}-d{digits}.parquet"
    from postrl.data import generate_addition, write_parquet

    train.parent.mkdir(parents=True, exist_ok=True)
    if not train.exists():
        write_parquet(generate_addition(n_train, seed=0, max_digits=digits), train)
    if not test.exists():
        write_parquet(generate_addition(n_test, seed=1, split="test", max_digits=digits), test)
    return train, test


def _run(arm: str, seed: int, a: argparse.Namespace, train: Path, test: Path) -> dict:
    out = Path(a.work_dir) / f"{arm}-s{seed}"
    marks = ",".join(str(m) for m in a.marks)
    recipe, _, _, arms = TASKS[a.task]
    cmd = [
        sys.executable,
        "-m",
        "postrl.cli",
        "train",
        str(recipe),
        f"model.path={a.model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{test}]",
        f"trainer.run_dir={out}",
        f"trainer.seed={seed}",
        f"trainer.time_budget_s={a.budget_s}",
        f"trainer.test_at_s=[{marks}]",
        f"trainer.num_threads={a.threads}",
        "trainer.resume_mode=disable",
        "trainer.loggers=[jsonl]",
        *(o.replace(TEACHER, a.teacher) for o in arms[arm]),
        *a.extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"arm {arm} seed {seed} failed (exit {proc.returncode})")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [
        (r.get("perf/train_time_s", 0.0), r["val/acc/mean"]) for r in rows if "val/acc/mean" in r
    ]
    steps = [r for r in rows if r["step"] > 0]
    signal = [
        r["dynamic_sampling/num_kept_groups"] / r["dynamic_sampling/num_groups"]
        for r in steps
        if r.get("dynamic_sampling/num_groups")
    ]
    return {
        "curve": curve,
        "steps": len(steps),
        "entropy_last": steps[-1].get("actor/entropy") if steps else None,
        "kept_group_share": sum(signal) / len(signal) if signal else None,
    }


def accuracy_at(curve: list[tuple[float, float]], mark: float) -> float:
    """Accuracy of the first validation at or after ``mark`` seconds of training."""
    return next((acc for t, acc in curve if t >= mark), curve[-1][1])


def _plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, seeds in results.items():
        for i, r in enumerate(seeds.values()):
            t, acc = zip(*r["curve"])
            ax.plot(
                [x / 60 for x in t],
                acc,
                marker="o",
                label=arm if i == 0 else None,
                color=f"C{list(results).index(arm)}",
                alpha=0.9 if i == 0 else 0.5,
            )
    ax.set_xlabel("training time (min, 2 threads)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    """Run the arms (see the module docstring) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--task",
        choices=list(TASKS),
        default="3digit",
        help="3digit: the shared warmed model on 3-digit sums; quickstart: 1-digit sums from "
        "runs/quickstart/sft-model (make quickstart builds it), arms qs*",
    )
    p.add_argument(
        "--arms", nargs="+", default=None, choices=[*ARMS, *QS_ARMS], help="default: w1 recipe"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--marks", type=float, nargs="+", default=[120.0, 300.0, 600.0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="default: the task's starting model")
    p.add_argument("--work-dir", default="runs/learning")
    p.add_argument("--train-size", type=int, default=20000, help="training prompts")
    p.add_argument("--test-size", type=int, default=1000, help="held-out prompts")
    p.add_argument("--extra", nargs="*", default=[], help="overrides applied to every arm")
    p.add_argument(
        "--teacher",
        default="runs/opd/teacher",
        help="the distillation teacher of the opd* arms (examples/opd_addition_3digit.sh)",
    )
    p.add_argument(
        "--report",
        nargs="+",
        default=None,
        metavar="RESULTS_JSON",
        help="run nothing: merge these results.json files (arm -> seed -> curve), print the "
        "table at --marks and plot to --work-dir/learning.png",
    )
    a = p.parse_args(argv)
    _, model, digits, arms = TASKS[a.task]
    a.model = a.model or str(model)
    a.arms = a.arms or (["w1", "recipe"] if a.task == "3digit" else ["qs", "qs-dapo"])
    wrong = [x for x in a.arms if x not in arms]
    if wrong:
        p.error(f"--arms {wrong} are not arms of --task {a.task}; choose from {list(arms)}")
    if any(TEACHER in o for x in a.arms for o in arms[x]) and not Path(a.teacher).exists():
        p.error(
            f"--teacher {a.teacher} does not exist: build it with examples/opd_addition_3digit.sh"
        )
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if a.report:
        results: dict[str, dict] = {}
        for f in a.report:
            for arm, seeds in json.loads(Path(f).read_text())["runs"].items():
                results.setdefault(arm, {}).update(seeds)
    else:
        train, test = _data(work, a.train_size, a.test_size, digits)
        results = {arm: {} for arm in a.arms}
        for seed in a.seeds:
            for arm in a.arms:
                sys.stderr.write(f"==> {arm}, seed {seed}\n")
                results[arm][str(seed)] = _run(arm, seed, a, train, test)
        (work / "results.json").write_text(json.dumps({"args": vars(a), "runs": results}, indent=1))
    _table(results, [0.0, *a.marks])
    title = (
        "3-digit addition from the warmed tiny model"
        if a.task == "3digit"
        else "1-digit addition from the quickstart's SFT model"
    )
    _plot(results, work / "learning.png", title)
    print(f"results: {work / 'results.json'}, curves: {work / 'learning.png'}")
    return 0


def _table(results: dict, marks: list[float]) -> None:
    """Mean held-out accuracy over seeds at each mark (a run shorter than a mark shows '-')."""
    print("held-out greedy accuracy by training time (mean over seeds)")
    print(f"{'arm':>12} " + " ".join(f"{m:>6.0f}s" for m in marks) + "  seeds   steps  kept-groups")
    for arm, seeds in results.items():
        cells = []
        for m in marks:
            have = [r for r in seeds.values() if r["curve"][-1][0] >= m - 1.0]
            acc = sum(accuracy_at(r["curve"], m) for r in have) / len(have) if have else None
            cells.append(f"{acc:>7.3f}" if acc is not None else f"{'-':>7}")
        steps = sum(r["steps"] for r in seeds.values()) / len(seeds)
        kept = [r["kept_group_share"] for r in seeds.values() if r["kept_group_share"]]
        share = f"{sum(kept) / len(kept):.2f}" if kept else "-"
        print(f"{arm:>12} " + " ".join(cells) + f"  {len(seeds):>5}  {steps:>6.0f}  {share:>6}")


if __name__ == "__main__":
    raise SystemExit(main())
