"""verl's launch command, run by postrl: ``python -m postrl.verl.main_ppo [verl key=value ...]``.

The same as ``postrl verl ...``. A verl user changes one word of a launch script
(``verl.trainer.main_ppo`` -> ``postrl.verl.main_ppo``) and keeps every ``key=value``.

Options (besides verl's keys):

* ``--print-config``: print the translated postrl YAML (only the settings that differ from
  postrl's defaults; ``postrl train FILE`` runs exactly this config) and exit.
* ``--config-path DIR --config-name NAME``: read a verl YAML config (``DIR/NAME.yaml``) first;
  the command-line keys win. Its ``defaults:`` list may name only ``ppo_trainer`` and ``_self_``.
* ``-h`` / ``--help``: this text.

Before training, the translated config is written to ``RUN_DIR/verl_translated.yaml`` (and
the verl arguments to ``RUN_DIR/verl_args.txt``); the run itself is ``postrl train`` on that
file, so the two entry points cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from postrl.config import PostRLConfig, to_dict
from postrl.config.schema import config_key
from postrl.verl.translate import Translation, VerlConfigError, translate

logger = logging.getLogger(__name__)

__all__ = ["main", "minimal_yaml", "split_options"]


def _diff(value: Any, default: Any) -> Any:
    """The fields of dataclass ``value`` that differ from ``default``; ``None``: no difference.

    A nested section whose field default differs from its class's defaults (the critic's
    optimizer: lr 1e-5) is written whole when anything in it differs, because the loader fills
    a partial section from the class's defaults.
    """
    if not dataclasses.is_dataclass(value):
        return None if value == default else value
    out = {}
    for f in dataclasses.fields(value):
        v, d = getattr(value, f.name), getattr(default, f.name)
        sub = _diff(v, d)
        if sub is None:
            continue
        if dataclasses.is_dataclass(v) and d != type(d)():
            sub = to_dict(v)
        out[config_key(f)] = sub
    return out or None


def minimal_yaml(t: Translation) -> str:
    """The translated config as YAML: the keys that differ from postrl's defaults.

    ``load_config`` of this text gives back ``t.config`` exactly. Notes (accepted keys without
    effect) head the file as comments.
    """
    body = _diff(t.config, PostRLConfig()) or {}
    head = ["# postrl config translated from verl arguments (postrl train THIS_FILE runs it)"]
    head += [f"# {line}" for line in t.notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False)


def split_options(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Separate ``--print-config``, ``--config-path/--config-name`` and ``-h`` from verl keys."""
    opts: dict[str, Any] = {"print_config": False, "help": False, "path": None, "name": None}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("-h", "--help"):
            opts["help"] = True
        elif arg == "--print-config":
            opts["print_config"] = True
        elif arg.startswith(("--config-path", "--config-name", "--config_path", "--config_name")):
            flag, _, value = arg.partition("=")
            if not value:
                value = next(it, "")
            opts["path" if "path" in flag else "name"] = value
        elif arg.startswith("--"):
            raise VerlConfigError(
                f"unknown option {arg!r}: postrl verl takes --print-config, --config-path, "
                "--config-name and verl's key=value arguments"
            )
        else:
            rest.append(arg)
    return opts, rest


def _load_base(path: str | None, name: str | None) -> dict[str, Any]:
    if not name:
        return {}
    file = Path(path or ".") / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not file.is_file():
        raise VerlConfigError(f"--config-name: {file} does not exist")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise VerlConfigError(f"{file} must hold a mapping at top level")
    defaults = data.pop("defaults", [])
    for item in defaults or []:
        if item not in ("ppo_trainer", "_self_") and item != {"ppo_trainer": None}:
            raise VerlConfigError(
                f"{file}: defaults entry {item!r} is not supported (postrl's table already "
                "holds ppo_trainer's defaults; put overrides in this file or on the command line)"
            )
    if name in ("ppo_trainer", "_generated_ppo_trainer"):
        return {}  # verl's own defaults file: the table holds these already
    return data


def _run(t: Translation, argv: list[str]) -> int:
    from postrl.trainer.run import eval_main, train_main

    run_dir = Path(t.config.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "verl_translated.yaml"
    path.write_text(minimal_yaml(t))
    (run_dir / "verl_args.txt").write_text("\n".join(argv) + "\n")
    logger.info("verl arguments translated to %s", path)
    entry = eval_main if t.val_only else train_main
    # a row verl would also refuse (e.g. a prompt over the limit) exits 2 with the message,
    # which names the data.* key to change (train_main / eval_main catch DatasetError)
    return entry(str(path), [])


def main(argv: list[str] | None = None) -> int:
    """Translate verl's arguments and train (or print the config); returns an exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, keys = split_options(argv)
        if opts["help"]:
            sys.stdout.write((__doc__ or "") + "\nKeys: docs/verl.md\n")
            return 0
        t = translate(keys, base=_load_base(opts["path"], opts["name"]))
    except VerlConfigError as e:
        logger.error("%s", e)
        return 2
    if opts["print_config"]:
        sys.stdout.write(minimal_yaml(t))
        return 0
    return _run(t, argv)


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


if __name__ == "__main__":
    _setup_logging()
    raise SystemExit(main())
