"""``RUN_DIR/trained_prompts.jsonl``: which prompts every step trained on.

One line per completed step, ``{"step": s, "epoch": e, "uid": [...], "index": [...],
"epochs": [...]}`` — the group uids of the step's batch, their dataset row indices and the
epoch each group was drawn in, in batch order (``epoch``: the oldest of them). A resumed run
truncates the file to the steps before it (as ``metrics.jsonl``), so the file always says what
the run as a whole trained: counting the indices of an epoch shows every prompt trained exactly
once, in every mode, across kills and resumes (the tests do exactly that).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from postrl.protocol import DataProto
from postrl.tracking.sinks import truncate_steps

__all__ = ["TrainedLedger", "trained_groups", "read_ledger"]

LEDGER = "trained_prompts.jsonl"


def trained_groups(batch: DataProto) -> list[tuple[str, int]]:
    """``(uid, dataset index)`` of every group in ``batch``, first-seen order (index -1 when
    the dataset has no ``index`` column)."""
    nt = batch.non_tensor_batch
    index = nt.get("index")
    seen: dict[str, int] = {}
    for i, uid in enumerate(nt["uid"]):
        seen.setdefault(str(uid), int(index[i]) if index is not None else -1)
    return list(seen.items())


class TrainedLedger:
    """Appends one line per step to ``RUN_DIR/trained_prompts.jsonl`` (see the module
    docstring); ``start_step``: rows from it on are dropped first (a resumed run)."""

    def __init__(self, run_dir: Path, start_step: int = 1) -> None:
        self.path = Path(run_dir) / LEDGER
        truncate_steps(self.path, start_step)
        self._fh = self.path.open("a")

    def log(
        self,
        step: int,
        epoch: int,
        groups: list[tuple[str, int]],
        group_epochs: dict[str, int] | None = None,
    ) -> None:
        """Record step ``step``'s groups; ``group_epochs`` (uid → epoch, when the batch came
        from the replay buffer) adds ``epochs``, each group's own epoch (a stale group's retry
        may train next to groups of the next epoch)."""
        row: dict[str, Any] = {"step": step, "epoch": epoch, "uid": [u for u, _ in groups]}
        row["index"] = [i for _, i in groups]
        if group_epochs:
            row["epochs"] = [int(group_epochs.get(u, epoch)) for u, _ in groups]
        self._fh.write(json.dumps(row) + "\n")
        self._fh.flush()

    def close(self) -> None:
        """Close the file."""
        self._fh.close()


def read_ledger(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``RUN_DIR/trained_prompts.jsonl``."""
    p = Path(run_dir) / LEDGER
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
