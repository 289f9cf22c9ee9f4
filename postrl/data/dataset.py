"""Parquet datasets in verl's schema and a resumable, seeded prompt loader.

``RLDataset`` reads rows (``data_source``, ``prompt`` = chat messages, ``ability``,
``reward_model.{style, ground_truth}``, ``extra_info``, optional ``agent_name``), validates
every row up front (a malformed row raises :class:`DatasetError` naming file, row and field),
applies the tokenizer's chat template once and keeps the prompt token ids. Prompts longer than
``max_prompt_length`` are dropped and counted (``truncation="filter"``) or raise naming the row
(``truncation="error"``).

``PromptLoader`` yields batches as :class:`~postrl.protocol.DataProto` with non-tensor columns
(``raw_prompt_ids``, ``messages``, ``data_source``, ``ground_truth``, ``extra_info``,
``agent_name``, ``index``); its ``state_dict`` (epoch, position) makes resume exact: no prompt is
replayed or skipped.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from postrl.data.tasks import read_rows
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["DatasetError", "RLDataset", "PromptLoader", "validate_row"]

_ROLES = {"system", "user", "assistant", "tool"}


class DatasetError(ValueError):
    """A malformed dataset row; the message names the file, the row index and the field."""


def validate_row(row: Any, where: str, prompt_key: str = "prompt") -> None:
    """Raise :class:`DatasetError` unless ``row`` follows verl's schema."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: row is {type(row).__name__}, expected a mapping")
    for key in ("data_source", prompt_key, "reward_model"):
        if key not in row or row[key] is None:
            raise DatasetError(
                f"{where}: missing field {key!r} "
                f"(verl schema needs data_source, {prompt_key}, reward_model)"
            )
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise DatasetError(
            f"{where}: field 'data_source' must be a non-empty string, got {row['data_source']!r}"
        )
    msgs = row[prompt_key]
    if isinstance(msgs, np.ndarray):
        msgs = msgs.tolist()
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(
            f"{where}: field {prompt_key!r} must be a non-empty list of chat messages, "
            f"got {msgs!r:.80}"
        )
    for j, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: field {prompt_key}[{j}] must be {{'role': str, 'content': str}}, "
                f"got {m!r:.80}"
            )
        if m["role"] not in _ROLES:
            raise DatasetError(
                f"{where}: field {prompt_key}[{j}].role={m['role']!r} "
                f"is not one of {sorted(_ROLES)}"
            )
    if not any(m["content"].strip() for m in msgs):
        raise DatasetError(
            f"{where}: field {prompt_key!r} is empty (all messages have empty content)"
        )
    rm = row["reward_model"]
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DatasetError(
            f"{where}: field 'reward_model' must be a mapping with 'ground_truth', got {rm!r:.80}"
        )
    if rm["ground_truth"] is None:
        raise DatasetError(f"{where}: field 'reward_model.ground_truth' is null")
    ei = row.get("extra_info")
    if ei is not None and not isinstance(ei, dict):
        raise DatasetError(
            f"{where}: field 'extra_info' must be a mapping or null, got {type(ei).__name__}"
        )


@dataclass
class RLDataset:
    """Validated, tokenized prompts from one or more parquet files.

    Args:
        files: parquet (or jsonl) paths in verl's schema.
        tokenizer: a HF tokenizer with a chat template.
        max_prompt_length: token limit after the chat template.
        truncation: ``error`` or ``filter``.
        prompt_key: column with the chat messages.
        max_samples: keep at most this many rows (0 = all).
    """

    files: list[str]
    tokenizer: Any
    max_prompt_length: int = 256
    truncation: str = "error"
    prompt_key: str = "prompt"
    max_samples: int = 0
    rows: list[dict[str, Any]] = field(init=False, default_factory=list)
    prompt_ids: list[list[int]] = field(init=False, default_factory=list)
    num_filtered: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.truncation not in ("error", "filter"):
            raise DatasetError(f"truncation={self.truncation!r} must be 'error' or 'filter'")
        rows: list[dict[str, Any]] = []
        for f in self.files:
            file_rows = read_rows(f)
            for i, r in enumerate(file_rows):
                validate_row(r, f"{f}: row {i}", self.prompt_key)
                r = dict(r)
                r["_where"] = f"{f}: row {i}"
                rows.append(r)
        if self.max_samples:
            rows = rows[: self.max_samples]
        texts = [
            self.tokenizer.apply_chat_template(
                _messages(r[self.prompt_key]), add_generation_prompt=True, tokenize=False
            )
            for r in rows
        ]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        kept_rows, kept_ids = [], []
        for r, p in zip(rows, ids):
            if len(p) > self.max_prompt_length:
                if self.truncation == "error":
                    raise DatasetError(
                        f"{r['_where']}: prompt has {len(p)} tokens > "
                        f"data.max_prompt_length={self.max_prompt_length}; "
                        f"raise data.max_prompt_length or set data.truncation=filter"
                    )
                self.num_filtered += 1
                continue
            kept_rows.append(r)
            kept_ids.append(list(p))
        if self.num_filtered:
            logger.warning(
                "filtered %d prompts longer than max_prompt_length=%d",
                self.num_filtered,
                self.max_prompt_length,
            )
        if not kept_rows:
            raise DatasetError(
                f"no usable rows in {self.files} (filtered {self.num_filtered} over-long prompts)"
            )
        self.rows, self.prompt_ids = kept_rows, kept_ids

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: list[int] | np.ndarray) -> DataProto:
        """Rows ``indices`` as a DataProto of non-tensor columns (no tensors yet)."""
        rows = [self.rows[i] for i in indices]
        return DataProto.from_dict(
            non_tensors={
                "raw_prompt_ids": [self.prompt_ids[i] for i in indices],
                "messages": [_messages(r[self.prompt_key]) for r in rows],
                "data_source": [r["data_source"] for r in rows],
                "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
                "extra_info": [dict(r.get("extra_info") or {}) for r in rows],
                "agent_name": [r.get("agent_name") for r in rows],
                "index": list(map(int, indices)),
            }
        )


def _messages(msgs: Any) -> list[dict[str, str]]:
    if isinstance(msgs, np.ndarray):
        msgs = msgs.tolist()
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


@dataclass
class PromptLoader:
    """Seeded epoch permutations, batches of ``batch_size`` prompts, exact resume.

    The order of epoch ``e`` is ``permutation(len, seed=(seed, e))``; the state is just
    ``(epoch, position)``. A trailing partial batch is dropped (counted in ``dropped_per_epoch``)
    so every step has the configured size.
    """

    dataset: RLDataset
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    sampler: Any = None
    """A :class:`~postrl.data.samplers.PromptSampler` adding replays to each draw (None: the
    permutation only)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _orders: tuple[int, np.ndarray] = field(
        default=(-1, np.empty(0, dtype=np.int64)), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.batch_size > len(self.dataset):
            raise DatasetError(
                f"data.train_batch_size={self.batch_size} exceeds the {len(self.dataset)} "
                "usable prompts; lower it or add data"
            )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    @property
    def dropped_per_epoch(self) -> int:
        return len(self.dataset) % self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if self._orders[0] != epoch:  # (a skipping sampler walks it in many short draws)
            if not self.shuffle:
                order = np.arange(len(self.dataset))
            else:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._orders = (epoch, order)
        return self._orders[1]

    def next_batch(self) -> DataProto:
        """Return the next batch and advance (wrapping into the next epoch)."""
        return self.next_prompts(self.batch_size)

    def next_prompts(self, k: int) -> DataProto:
        """The next ``k`` prompts of the order, advancing. ``next_batch`` is
        ``next_prompts(batch_size)``; DAPO's refill draws the exact number of groups it evicted.

        At an epoch's end: from a position on the batch grid, the trailing partial batch is
        skipped (``dropped_per_epoch``) and the next epoch starts; from a position off it (refills
        drew single prompts), the rest of the epoch is drawn and the draw goes on into the next
        epoch — an epoch's prompts are never skipped mid-way. ``meta_info["epoch"]`` is the
        epoch of the draw's last prompt; ``meta_info["epochs"]`` each row's own (replays: the
        current epoch).

        A sampler with a ``skip(indices)`` method (``greso``) may pass over fresh prompts before
        they are generated: the walk goes on until ``k`` are drawn. The sampler counts what it
        skipped (``sampler/skipped``); after a whole dataset's worth of prompts scanned in one
        draw nothing more is skipped, so a draw always ends."""
        if not 0 < k <= len(self.dataset):
            raise DatasetError(f"next_prompts({k}): k must be in [1, {len(self.dataset)}]")
        with self._lock:
            replays = self.sampler.replays(k) if self.sampler is not None else []
            skip = getattr(self.sampler, "skip", None)
            need, scanned = k - len(replays), 0
            heads: list[np.ndarray] = []
            epochs: list[int] = []
            while need > 0:
                head, ep = self._walk(need)
                scanned += len(head)
                if skip is not None and scanned <= len(self.dataset):
                    passed = np.asarray(skip(head.tolist()), dtype=bool)
                    head, ep = head[~passed], [e for e, s in zip(ep, passed.tolist()) if not s]
                heads.append(head)
                epochs += ep
                need -= len(head)
            order = np.concatenate([*heads, np.asarray(replays, dtype=np.int64)])
            out = self.dataset.batch(order)
            out.meta_info["epoch"] = self.epoch
            out.meta_info["epochs"] = epochs + [self.epoch] * len(replays)
        return out

    def _walk(self, fresh: int) -> tuple[np.ndarray, list[int]]:
        """The next ``fresh`` positions of the order (crossing an epoch's end as
        :meth:`next_prompts` says) and each one's epoch."""
        n = len(self.dataset)
        if self.position + fresh > n and self.position % self.batch_size == 0:
            self.epoch, self.position = self.epoch + 1, 0  # the trailing partial batch
        head = self._order(self.epoch)[self.position : self.position + fresh]
        epochs = [self.epoch] * len(head)
        self.position += len(head)
        if len(head) < fresh:  # off the grid: the epoch's rest, then the next epoch's first
            self.epoch, self.position = self.epoch + 1, fresh - len(head)
            tail = self._order(self.epoch)[: self.position]
            head = np.concatenate([head, tail])
            epochs += [self.epoch] * len(tail)
        return head.astype(np.int64, copy=False), epochs

    def sampler_metrics(self) -> dict[str, float]:
        """The sampler's ``sampler/*`` metrics since the last call (none without a sampler)."""
        if self.sampler is None:
            return {}
        with self._lock:
            return self.sampler.metrics()

    def observe(self, index: Any, uid: Any, scores: Any) -> None:
        """Report a scored batch to the sampler: rows grouped by ``uid``, each group's
        dataset ``index`` and response ``scores`` (a no-op without a sampler)."""
        if self.sampler is None:
            return
        groups: dict[Any, tuple[int, list[float]]] = {}
        for i, u, s in zip(np.asarray(index).tolist(), np.asarray(uid).tolist(), scores):
            groups.setdefault(u, (int(i), []))[1].append(float(s))
        with self._lock:  # (the stream reports filtered groups from its event-loop thread)
            self.sampler.observe([g[0] for g in groups.values()], [g[1] for g in groups.values()])

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position and seed (plus the sampler's state when it has one)."""
        with self._lock:
            state: dict[str, Any] = dict(epoch=self.epoch, position=self.position, seed=self.seed)
            if self.sampler is not None and (sampler_state := self.sampler.state_dict()):
                state["sampler"] = sampler_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        with self._lock:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
            if self.sampler is not None and "sampler" in state:
                self.sampler.load_state_dict(state["sampler"])


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained`` with a pad token guaranteed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
