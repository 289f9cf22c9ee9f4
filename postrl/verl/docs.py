"""Generate ``docs/verl.md`` (the migration guide) from the mapping table.

``python -m postrl.verl.docs`` rewrites the file; ``tests/verl/test_docs.py`` checks that the
committed copy is current. The prose lives here, the key reference comes from
:data:`postrl.verl.mapping.RULES`, and the worked example is translated live, so the guide
cannot drift from what ``postrl verl`` does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from postrl.verl.main_ppo import minimal_yaml
from postrl.verl.mapping import RULES
from postrl.verl.rules import Rule
from postrl.verl.translate import translate

__all__ = ["render_markdown", "EXAMPLE_ARGS"]

#: The worked example: verl's quickstart (PPO with a critic on GSM8K), sized for a laptop.
EXAMPLE_ARGS = [
    "data.train_files=data/gsm8k/train.parquet",
    "data.val_files=data/gsm8k/test.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=256",
    "data.max_response_length=64",
    "actor_rollout_ref.model.path=runs/tiny",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.name=native",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "critic.optim.lr=1e-5",
    "critic.model.path=runs/tiny",
    "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001",
    "trainer.logger=console",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.device=cpu",
    "trainer.save_freq=10",
    "trainer.test_freq=10",
    "trainer.total_epochs=15",
]

_INTRO = """\
# Coming from verl

postrl follows verl's architecture and accepts verl's launch commands. Change one word of a
launch script and keep every `key=value`:

```bash
python3 -m verl.trainer.main_ppo   data.train_files=... actor_rollout_ref.rollout.n=5 ...
python3 -m postrl.verl.main_ppo    data.train_files=... actor_rollout_ref.rollout.n=5 ...
postrl verl                        data.train_files=... actor_rollout_ref.rollout.n=5 ...
```

Every key of verl's `ppo_trainer.yaml` is handled by one table (`postrl/verl/mapping.py`, from
which the reference below is generated), in one of three ways:

* **mapped**: the value — yours, or verl's default when you leave the key out — becomes a
  postrl setting. verl's defaults hold: an unset `algorithm.adv_estimator` is `gae`, an unset
  `actor_rollout_ref.rollout.n` is 1, `weight_decay` is 0.01, `critic.ppo_mini_batch_size` follows
  the actor's, exactly as verl's interpolations say.
* **accepted, no effect**: the key is valid but means nothing here (`gpu_memory_utilization` on
  the CPU engine, `fsdp_config.param_offload`, `log_prob_micro_batch_size_per_gpu`, profilers);
  each one you set logs one line saying why.
* **rejected** unless left at verl's default: there is no postrl equivalent (Megatron,
  sequence parallelism, `critic_warmup`); the error gives the reason and the nearest supported
  setting. All problems are reported at once; a misspelt key gets a did-you-mean among verl's
  keys. Nothing is dropped silently.

`--print-config` prints the translated postrl YAML (only what differs from postrl's defaults)
and exits; `postrl train THAT_FILE` runs the same thing, so you can migrate for good. Every
run also writes it to `RUN_DIR/verl_translated.yaml`. `postrl.<key>=value` sets a postrl key
verl has no name for (`postrl.rollout.num_replicas=2`). `--config-path DIR --config-name NAME`
reads a verl YAML first (its `defaults:` may name only `ppo_trainer` and `_self_`).

`actor_rollout_ref.rollout.name=vllm` runs postrl's `vllm` backend (its engine in a replica
process of the vLLM venv: on CPU `make vllm-venv`, on GPU `pip install 'postrl[vllm]'`; see
[rollout.md](rollout.md#vllm-rolloutbackendvllm)); `sglang` needs SGLang installed. Without the
engine the translation stops and names the CPU alternative,
`actor_rollout_ref.rollout.name=native`. verl's defaults for `enforce_eager` (False),
`enable_chunked_prefill` (True) and `tensor_model_parallel_size` (2) are GPU settings: unless
you set them, the adapter's per-platform defaults apply instead (on CPU: eager, no chunked
prefill, one process); verl's `dtype` default (`bfloat16`) is kept, so the rollout runs in
bf16 while the trainer runs fp32 (|`rollout_corr/kl_k1`| 5e-4 to 6e-3 on the tiny model; set
`actor_rollout_ref.rollout.dtype=float32` for fp32 rollouts). Leaving `rollout.name` out
(verl requires it) picks `native`. On a machine without a GPU verl's default
`trainer.device=cuda` becomes `cpu` (logged) and `trainer.n_gpus_per_node` trains one
in-process worker.
"""

_DATA = """\
## Data and rewards, unchanged

Parquet files written by verl's `examples/data_preprocess/*.py` load as they are (verl's schema:
`data_source`, `prompt` as chat messages, `ability`, `reward_model.ground_truth`, `extra_info`).
Each `data_source` is scored by the rule verl's `default_compute_score` picks for it:

| data_source | rule (as verl) | score |
|---|---|---|
| `openai/gsm8k` | the last `#### N` in the final 300 characters, as a string | 1 / 0 |
| `DigitalLearningGmbH/MATH-lighteval` | the last `\\boxed{}`, Hendrycks-normalised | 1 / 0 |
| `lighteval/MATH` | as `DigitalLearningGmbH/MATH-lighteval` | 1 / 0 |
| `HuggingFaceH4/MATH-500` | as `DigitalLearningGmbH/MATH-lighteval` | 1 / 0 |
| `math_dapo` | the last `Answer:` line (Minerva), else the last `\\boxed{}` | +1 / -1 |
| `math_dapo_reasoning` | as `math_dapo` | +1 / -1 |
| `aime`, `aime24`, `aime2024`, `aime_2024`, ... | as `math_dapo` | +1 / -1 |

A differential test against verl's own functions agreed on 40,000 fuzzed responses. Two names
keep postrl's rules: `gsm8k` (lenient: last number, numeric compare) and `math` (math-verify
equivalence; verl scores `math` with its DAPO rule — name such rows `math_dapo`). verl's AIME
match is any name starting with `aime`; postrl lists the common spellings. Sources verl
scores with a sandbox or other packages (`codecontests`, `numina_*`, `searchR1_*`,
`hiyouga/geometry3k`) are not built in: score them with a custom function.

A custom reward file written for verl works as is: `custom_reward_function.path=my_reward.py
custom_reward_function.name=compute_score` with the signature
`compute_score(data_source, solution_str, ground_truth, extra_info)`; extra keyword arguments
come from `+custom_reward_function.reward_kwargs.NAME=VALUE`. A float, or a dict with `score`
whose other numeric keys become `reward/extra/<key>/mean` metrics, as in verl.
"""

_DIFFERENCES = """\
## What postrl does differently

* **Embedded CPU defaults.** `postrl verl` runs on a laptop: the `native` engine, one in-process
  worker, float32 compute. The same command with `rollout.name=vllm` on GPUs uses vLLM and Ray.
* **Exact resume.** A resumed run reproduces the uninterrupted run's metrics; checkpoints hold
  the data order, optimizer and trainer state (`trainer.resume_mode=auto` resumes by default).
* **Failed rewards are masked, not zero.** A reward function that raises, hangs past its
  deadline or returns NaN marks that sample as failed (counted in `reward/failed/*`) and removes
  it from the loss; verl would train on a 0 score.
* **Typed validation before anything starts.** Batch-size contracts, registry names and file
  paths are checked up front, every problem reported at once with the field and the fix.
* **One seed.** `data.seed` (else 0) seeds data order, initialisation and sampling; verl's
  separate `rollout.seed`, `data_loader_seed` and `fsdp_config.seed` are accepted without effect.
* **Validation cadence.** `trainer.test_freq<=0` still validates once after the last step.
* **Metrics** keep verl's names (`critic/score/mean`, `actor/pg_loss`, `response_length/mean`,
  `timing_s/gen`, ...) and always go to `RUN_DIR/metrics.jsonl` besides `trainer.logger`
  (`console`, `wandb`, `tensorboard`; `file` is `jsonl`).
"""


def _fmt(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return f"`{text}`".replace("|", "\\|") if text != "" else "`''`"


def _row(rule: Rule) -> str:
    key = f"`{rule.key}`"
    default = "" if rule.is_tree else _fmt(rule.default)
    if rule.kind == "map":
        what = f"→ `{rule.to}`" if rule.to and not rule.to.startswith("(") else rule.to
        note = rule.why
    elif rule.kind == "noop":
        what, note = "accepted, no effect", rule.why
    else:
        if rule.is_tree:
            what = "rejected when set (false/null/0 pass)"
        else:
            extra = f" or {', '.join(map(repr, rule.ok))}" if rule.ok else ""
            what = f"rejected unless default{extra}"
        note = f"{rule.why}; use {rule.nearest}" if rule.nearest else rule.why
    return f"| {key} | {default} | {what} | {note.replace('|', '/')} |"


def render_markdown() -> str:
    """The whole migration guide as Markdown."""
    t = translate(EXAMPLE_ARGS)
    verl_cmd = " \\\n    ".join(["python3 -m verl.trainer.main_ppo", *EXAMPLE_ARGS])
    postrl_cmd = " \\\n    ".join(["postrl verl", *EXAMPLE_ARGS])
    lines = [
        _INTRO,
        "## Worked example: verl's quickstart (PPO with a critic)",
        "",
        "verl's quickstart command, sized for a laptop (`postrl make-model runs/tiny` makes the "
        "model; the data is verl's `examples/data_preprocess/gsm8k.py` output):",
        "",
        "```bash",
        verl_cmd,
        "```",
        "",
        "The same run with postrl — the same arguments:",
        "",
        "```bash",
        postrl_cmd,
        "```",
        "",
        "and what it translates to (`postrl verl ... --print-config`), which `postrl train "
        "ppo.yaml` runs unchanged:",
        "",
        "```yaml",
        minimal_yaml(t).rstrip(),
        "```",
        "",
        _DATA,
        _DIFFERENCES,
        "## Key reference",
        "",
        "Generated from `postrl/verl/mapping.py` by `python -m postrl.verl.docs`. A key ending in "
        "`.*` covers every key below it.",
        "",
    ]
    groups: dict[str, list[Rule]] = {}
    for rule in RULES:
        parts = rule.key.split(".")
        top = (
            ".".join(parts[:2]) if parts[0] == "actor_rollout_ref" and len(parts) > 2 else parts[0]
        )
        groups.setdefault(top, []).append(rule)
    for group, rules in groups.items():
        lines += ["", f"### `{group}`", "", "| verl key | verl default | postrl | notes |"]
        lines.append("|---|---|---|---|")
        lines += [_row(r) for r in rules]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write ``docs/verl.md`` next to the package's repository root."""
    root = Path(__file__).resolve().parents[2]
    (root / "docs" / "verl.md").write_text(render_markdown())
    sys.stdout.write("wrote docs/verl.md\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
