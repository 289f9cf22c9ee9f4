"""postrl.supervised — the supervised programs: SFT (``postrl sft``) and reward-model training
(``postrl rm``).

Each reads one data file, trains with the engine (:mod:`postrl.engine`) and writes an HF model;
neither runs a rollout, a mode or a worker group, so they sit beside ``trainer/``, not in it
(``docs/architecture.md``, "Layers"). ``sft.py``: :func:`run_sft` / :func:`sft_main`;
``rm.py``: :func:`run_rm` / :func:`rm_main` (Bradley–Terry on preference pairs); ``common.py``:
their command line (:func:`parse_options`) and learning-rate schedule
(:func:`warmup_cosine_scheduler`). Their options are :mod:`postrl.config.supervised`.
"""

from postrl.supervised.common import parse_options, warmup_cosine_scheduler
from postrl.supervised.rm import rm_main, run_rm
from postrl.supervised.sft import run_sft, sft_main, tokenize_rows

__all__ = [
    "parse_options",
    "rm_main",
    "run_rm",
    "run_sft",
    "sft_main",
    "tokenize_rows",
    "warmup_cosine_scheduler",
]
