"""The ``postrl`` command line:
make-model | data | sft | rm | train | verl | eval | serve | bench | export.

Every subcommand imports its heavy dependencies lazily so ``postrl --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from types import SimpleNamespace


def _cmd_make_model(args: argparse.Namespace) -> int:
    from postrl.testing import make_model

    out = make_model(
        args.out_dir, preset=args.preset, arch=args.arch, seed=args.seed, head=args.head
    )
    from safetensors import safe_open

    with safe_open(str(Path(out) / "model.safetensors"), "pt") as f:
        n = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    kind = "reward model" if args.head == "reward" else "model"
    print(
        f"wrote {args.preset} {args.arch} {kind} ({n / 1e6:.2f}M params, seed {args.seed}) to {out}"
    )
    return 0


def _prod(shape) -> int:
    p = 1
    for s in shape:
        p *= int(s)
    return p


def _cmd_data(args: argparse.Namespace) -> int:
    from postrl import data

    if args.task == "gsm8k":
        if not args.input:
            raise SystemExit(
                "postrl data gsm8k needs --input FILE.jsonl|parquet (a local GSM8K/MATH-style file)"
            )
        rows = data.convert_gsm8k(args.input, split=args.split)
    elif args.task == "tool-arith":
        from postrl.data.tool_arith import generate_tool_arith, tool_arith_demonstrations

        kw = dict(
            min_digits=args.min_digits,
            max_digits=9 if args.max_digits is None else args.max_digits,
            kinds=args.kinds.split(","),
            prompt_style=args.prompt_style,
            result_digits=args.result_digits,
        )
        if args.sft:
            rows = tool_arith_demonstrations(
                args.n,
                seed=args.seed,
                tool_fraction=args.tool_fraction,
                copy_fraction=args.copy_fraction,
                **kw,
            )
        else:
            rows = generate_tool_arith(args.n, seed=args.seed, split=args.split, **kw)
    elif args.task == "verifiers":
        rows = _verifiers_data(args)
    elif args.task in _env_names() or ":" in args.task:  # "module:Class" of an environment
        rows = _env_data(args)
    elif args.task in data.TASKS:
        extra = {}
        if args.max_digits is not None:
            if args.task != "addition":
                raise SystemExit(
                    f"postrl data {args.task}: --max-digits applies to addition and tool-arith only"
                )
            extra["max_digits"] = args.max_digits
        rows = data.TASKS[args.task](args.n, seed=args.seed, split=args.split, **extra)
        if args.sft and args.pairs:
            raise SystemExit("postrl data: --sft and --pairs are exclusive")
        if args.sft:
            rows = data.sft_rows_from_rl_rows(rows)
        if args.pairs:
            rows = data.preference_pairs(rows, seed=args.seed)
    else:
        raise SystemExit(
            f"unknown data task {args.task!r}; choose from gsm8k, {', '.join(data.TASKS)}"
        )
    path = data.write_parquet(rows, args.out)
    print(f"wrote {len(rows)} {args.task} rows ({args.split}) to {path}")
    return 0


def _verifiers_data(args: argparse.Namespace) -> list[dict]:
    """One row per task of a verifiers taskset (read by starting the verifiers worker)."""
    import json

    from postrl.agent.verifiers import check_verifiers_config, dataset_rows, list_tasks
    from postrl.config.schema import VerifiersConfig

    if not args.taskset:
        raise SystemExit("postrl data verifiers needs --taskset MODULE (the verifiers taskset id)")
    try:
        env = json.loads(args.env_kwargs) if args.env_kwargs else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"postrl data verifiers: --env-kwargs is not JSON ({e})") from e
    vf = VerifiersConfig(
        taskset=args.taskset,
        env=env,
        python=args.python or "",
        python_path=[p for p in (args.python_path or "").split(":") if p],
    )
    errors = check_verifiers_config(SimpleNamespace(verifiers=vf))
    if errors:
        raise SystemExit("postrl data verifiers: " + "; ".join(errors))
    return dataset_rows(list_tasks(vf), args.taskset)


def _env_names() -> list[str]:
    from postrl.envs import ENVS

    return ENVS.names()


def _env_data(args: argparse.Namespace) -> list[dict]:
    """Rows of an environment's episodes (``--sft``: expert transcripts)."""
    import json

    from postrl.envs import env_demonstrations, env_rows

    try:
        kw = json.loads(args.env_kwargs) if args.env_kwargs else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"postrl data {args.task}: --env-kwargs is not JSON ({e})") from e
    if args.sft:
        return env_demonstrations(
            args.task,
            args.n,
            seed=args.seed,
            noise=args.noise,
            max_turns=args.max_turns,
            env_kwargs=kw,
        )
    return env_rows(args.task, args.n, seed=args.seed, split=args.split, env_kwargs=kw)


def _config_and_overrides(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """``postrl train a=b c=d`` (no YAML) puts the first override in ``config``; move it back."""
    if args.config and "=" in args.config:
        return None, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from postrl.trainer.run import train_main

    return train_main(*_config_and_overrides(args))


def _cmd_sft(args: argparse.Namespace) -> int:
    from postrl.supervised.sft import sft_main

    config, overrides = _config_and_overrides(args)
    return sft_main([config, *overrides] if config else overrides)


def _cmd_rm(args: argparse.Namespace) -> int:
    from postrl.supervised.rm import rm_main

    config, overrides = _config_and_overrides(args)
    return rm_main([config, *overrides] if config else overrides)


def _cmd_eval(args: argparse.Namespace) -> int:
    from postrl.trainer.run import eval_main

    return eval_main(*_config_and_overrides(args))


def _cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    from postrl.rollout.server import serve_main

    return serve_main(rest)


def _cmd_verl(args: argparse.Namespace, rest: list[str]) -> int:
    from postrl.verl.main_ppo import main as verl_main

    return verl_main(rest)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    targets = {
        "rollout": "postrl.bench.rollout:main",
        "step": "postrl.bench.step:main",
        "modes": "postrl.bench.modes:main",
    }
    if args.what not in targets:
        raise SystemExit(f"unknown benchmark {args.what!r}; choose from {sorted(targets)}")
    mod, _, attr = targets[args.what].partition(":")
    return getattr(importlib.import_module(mod), attr)(rest) or 0


def _cmd_export(args: argparse.Namespace) -> int:
    from postrl.engine.checkpoint import export_hf

    export_hf(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``postrl`` command."""
    p = argparse.ArgumentParser(prog="postrl", description="RL post-training for language models.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("make-model", help="write a tiny random HF model + byte tokenizer")
    m.add_argument("out_dir")
    m.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    m.add_argument("--arch", default="qwen2", choices=["qwen2", "llama", "qwen3"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--head",
        default="causal_lm",
        choices=["causal_lm", "reward"],
        help="reward: a one-label sequence classifier (for reward.model.path)",
    )
    m.set_defaults(fn=_cmd_make_model)

    d = sub.add_parser(
        "data", help="generate a synthetic task or convert a local dataset to verl parquet"
    )
    d.add_argument(
        "task",
        help="addition | countdown | gsm8k | tool-arith | code | an environment (frozenlake, "
        "sokoban: episodes for the env_agent loop) | verifiers (one row per task of "
        "--taskset, for the verifiers loop)",
    )
    d.add_argument("--taskset", help="verifiers: the taskset id (a module the worker imports)")
    d.add_argument(
        "--python-path", help="verifiers: ':'-separated folders put on the worker's PYTHONPATH"
    )
    d.add_argument(
        "--python", help="verifiers: the verifiers venv's python (default .venv-verifiers)"
    )
    d.add_argument("out", help="output .parquet")
    d.add_argument("--n", type=int, default=1000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--split", default="train", choices=["train", "test"])
    d.add_argument("--input", help="gsm8k: local input file (.jsonl or .parquet)")
    d.add_argument(
        "--pairs",
        action="store_true",
        help="write preference pairs (prompt, chosen = the correct answer, rejected = a wrong one) "
        "for `postrl rm`",
    )
    d.add_argument(
        "--sft",
        action="store_true",
        help="write SFT rows (messages with reference answers; tool-arith: multi-turn tool-use "
        "demonstrations)",
    )
    d.add_argument(
        "--min-digits", type=int, default=6, help="tool-arith: fewest digits per operand"
    )
    d.add_argument(
        "--max-digits",
        type=int,
        default=None,
        help="most digits per operand (tool-arith: default 9; addition: default 2, the quickstart "
        "uses 1)",
    )
    d.add_argument(
        "--kinds", default="mul,sum3,mulsub", help="tool-arith: comma-separated problem kinds"
    )
    d.add_argument(
        "--prompt-style",
        default="full",
        choices=["full", "short", "bound"],
        help="tool-arith: full (system message), short (question only) or bound (argument-free "
        "calls, bare answers)",
    )
    d.add_argument(
        "--result-digits",
        type=int,
        default=0,
        help="tool-arith: keep only problems whose result has this many characters (0 = any)",
    )
    d.add_argument(
        "--copy-fraction",
        type=float,
        default=0.0,
        help="tool-arith --sft: fraction of tool-reading rows (tool result -> answer, no question)",
    )
    d.add_argument(
        "--tool-fraction",
        type=float,
        default=1.0,
        help="tool-arith --sft: fraction of demonstrations that call the tool (others answer "
        "directly)",
    )
    d.add_argument(
        "--env-kwargs",
        default="",
        help='environments: JSON keyword arguments of the environment, e.g. \'{"size": 4, '
        '"holes": 3}\'',
    )
    d.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="environments --sft: probability of a random action per turn in the expert "
        "transcripts",
    )
    d.add_argument(
        "--max-turns", type=int, default=8, help="environments --sft: turns per transcript"
    )
    d.set_defaults(fn=_cmd_data)

    for name, fn, helptext in (
        ("train", _cmd_train, "run RL training from a YAML config"),
        ("sft", _cmd_sft, "supervised fine-tuning from a YAML config"),
        ("rm", _cmd_rm, "train a reward model on preference pairs (Bradley-Terry)"),
        ("eval", _cmd_eval, "validate a model on the val files of a config"),
    ):
        t = sub.add_parser(name, help=helptext)
        t.add_argument(
            "config", nargs="?", help="YAML config (optional; key=value overrides follow)"
        )
        t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.n=4")
        t.set_defaults(fn=fn)

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible server on 127.0.0.1 (see `postrl serve --help`)",
        add_help=False,
    )
    s.set_defaults(fn=_cmd_serve, passthrough=True)
    v = sub.add_parser(
        "verl",
        help="run a verl launch command (verl's key=value arguments; see docs/verl.md)",
        add_help=False,
    )
    v.set_defaults(fn=_cmd_verl, passthrough=True)
    b = sub.add_parser(
        "bench",
        help="benchmarks: rollout | step | modes (which trainer.mode to pick)",
        add_help=False,
    )
    b.add_argument("what", nargs="?", default="step")
    b.set_defaults(fn=_cmd_bench, passthrough=True)

    e = sub.add_parser("export", help="export a checkpoint to a plain Hugging Face directory")
    e.add_argument("checkpoint")
    e.add_argument("out")
    e.set_defaults(fn=_cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``postrl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if getattr(args, "passthrough", False):
        return int(args.fn(args, rest) or 0)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
