"""Load a user's reward function from a ``.py`` file by path (``reward.custom_function.path/name``).

The file is imported as a fresh module (not placed on ``sys.path``), so it may live anywhere.
The same loader runs inside reward worker processes, which import the file themselves: the
function is never pickled, so closures and lambdas defined in the file work too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["load_custom_reward_fn", "CustomRewardError"]


class CustomRewardError(ImportError):
    """The custom reward file or function is missing, fails to import, or is not callable."""


_CACHE: dict[tuple[str, str, float], Callable[..., Any]] = {}


def load_custom_reward_fn(path: str | Path, name: str = "compute_score") -> Callable[..., Any]:
    """Import ``path`` and return its attribute ``name`` (cached per file path + mtime).

    Args:
        path: a Python source file defining the function.
        name: the function's name in that file (verl's default is ``compute_score``).

    Raises:
        CustomRewardError: naming the path and function when the file does not exist, raises
            on import, lacks ``name`` or ``name`` is not callable.
    """
    p = Path(path).expanduser().resolve()
    where = f"reward.custom_function.path={str(path)!r}, name={name!r}"
    if not p.is_file():
        raise CustomRewardError(
            f"custom reward file not found ({where}); resolved to {p}. Fix the path (relative "
            f"paths resolve against the working directory {Path.cwd()})."
        )
    key = (str(p), name, p.stat().st_mtime)
    if key in _CACHE:
        return _CACHE[key]
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:12]
    module_name = f"postrl_custom_reward_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, p)
    if spec is None or spec.loader is None:
        raise CustomRewardError(f"cannot import custom reward file ({where}): not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets dataclasses/pickle inside the file resolve it
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise CustomRewardError(
            f"importing the custom reward file failed ({where}): {type(e).__name__}: {e}"
        ) from e
    if not hasattr(module, name):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise CustomRewardError(
            f"custom reward file defines no {name!r} ({where}); callables in it: "
            f"{', '.join(public) or '(none)'}. Set reward.custom_function.name to one of them."
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise CustomRewardError(
            f"custom reward {name!r} is a {type(fn).__name__}, not a function ({where})"
        )
    _CACHE[key] = fn
    return fn
