"""``AgentLoopManager``: runs n agent loops per prompt concurrently and assembles a DataProto.

Layout of the assembled batch (verl names; B = prompts × n, P/R = longest prompt/response in
this batch, not the configured maxima, so no compute is spent on padding that never occurs)::

    prompts          (B, P)    left-padded with pad_id
    responses        (B, R)    right-padded
    input_ids        (B, P+R)  prompts ‖ responses
    attention_mask   (B, P+R)  1 on real tokens
    position_ids     (B, P+R)  0.. over real tokens
    response_mask    (B, R)    1 on policy tokens (0 on padding and observation tokens)
    rollout_log_probs(B, R)    sampler log-probs (0 where response_mask is 0)
    rollout_policy_version (B, R) int64: policy version of the weights that sampled each token;
                               -1 on padding, observation tokens and where the loop reported none

Non-tensor columns: ``uid`` (one per prompt, shared by its n samples), ``sample_index`` (k),
``data_source``, ``ground_truth``, ``extra_info``, ``messages``, ``num_turns``, ``finish_reason``,
``segment`` (int64 per row: 0, or ``s`` on the row of a trajectory's ``s``-th entry of
``AgentLoopOutput.segments``, which shares its trajectory's ``uid`` and ``sample_index``),
``min_version`` / ``max_version`` (int64 per row: the oldest / newest policy version among the
row's sampled tokens, -1 when none is known — the replay buffer's tags read these, never the
tensor).
Sampling seeds are derived from ``(seed, step, prompt index, k)`` so a resumed run samples
exactly what the uninterrupted run sampled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import chain
from typing import Any

import numpy as np
import torch

from postrl.agent.base import AGENT_LOOPS, AgentLoopBase, AgentLoopOutput
from postrl.protocol import DataProto

logger = logging.getLogger(__name__)

__all__ = ["AgentLoopManager", "derive_seed"]

_MASK64 = (1 << 63) - 1


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (splitmix64 over the parts)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
    return x & _MASK64


class AgentLoopManager:
    """Run agent loops for a batch of prompts against a rollout client.

    Args:
        client: the rollout client (load-balanced over replicas).
        tokenizer: the policy tokenizer (pad id, decoding for rewards).
        agent_config: :class:`postrl.config.AgentConfig`.
        loop_kwargs: extra constructor arguments for agent loops (e.g. tools).
    """

    def __init__(self, client: Any, tokenizer: Any, agent_config: Any, **loop_kwargs: Any) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.config = agent_config
        self.loop_kwargs = loop_kwargs
        self._loops: dict[str, AgentLoopBase] = {}
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def _loop(self, name: str | None) -> AgentLoopBase:
        name = name or self.config.default_agent_loop
        if name not in self._loops:
            cls = AGENT_LOOPS.get(name)
            self._loops[name] = cls(self.client, self.tokenizer, self.config, **self.loop_kwargs)
        return self._loops[name]

    async def generate(
        self,
        prompts: DataProto,
        sampling: Any,
        n: int,
        *,
        seed: int,
        step: int,
        on_sample_end: Callable[[int, AgentLoopOutput, dict[str, Any]], None] | None = None,
    ) -> DataProto:
        """Run ``n`` samples per prompt row; returns the assembled batch (B = len × n).

        ``on_sample_end(i, output, row)`` is called as each trajectory finishes (the trainer uses
        it to start reward scoring while the rollout tail runs).
        """
        rows = self.rows(prompts, n, seed=seed, step=step)
        t0 = time.perf_counter()

        async def one(i: int, row: dict[str, Any]) -> AgentLoopOutput:
            out = await self.run(row, sampling)
            if on_sample_end is not None:
                on_sample_end(i, out, row)
            return out

        outputs = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        batch = self.assemble(outputs, rows)
        batch.meta_info["timing_s/agent_loop"] = time.perf_counter() - t0
        return batch

    @staticmethod
    def rows(prompts: DataProto, n: int, *, seed: int, step: int) -> list[dict[str, Any]]:
        """The ``n`` trajectory rows of every prompt row (dataset columns plus ``sample_index``,
        ``uid`` = ``"{step}-{index}"``, ``request_id`` and the sampling ``seed``
        derived from ``(seed, step, index, k)``), prompt by prompt."""
        nt = prompts.non_tensor_batch
        rows: list[dict[str, Any]] = []
        for p in range(len(prompts)):
            index = int(nt["index"][p]) if "index" in nt else p
            for k in range(n):
                row = {key: nt[key][p] for key in nt}
                row["sample_index"] = k
                row["uid"] = f"{step}-{index}"
                row["request_id"] = f"s{step}-p{index}-k{k}"
                row["seed"] = derive_seed(seed, step, index, k)
                rows.append(row)
        return rows

    async def run(self, row: dict[str, Any], sampling: Any) -> AgentLoopOutput:
        """Run one trajectory row (from :meth:`rows`) through its agent loop."""
        greedy = getattr(sampling, "temperature", 0) <= 0
        sp = sampling if greedy else sampling.evolve(seed=row["seed"])
        return await self._loop(row.get("agent_name")).run(sp, **row)

    async def aclose(self) -> None:
        """Release what the agent loops hold (the ``gateway`` loop's HTTP server)."""
        for loop in self._loops.values():
            close = getattr(loop, "aclose", None)
            if close is not None:
                await close()

    def check(self, outputs: list[AgentLoopOutput], rows: list[dict[str, Any]]) -> None:
        """Raise what :meth:`assemble` raises for these trajectories (per-token fields of unequal
        lengths, version segments that do not cover the response), without padding them."""
        outputs, rows, _ = _expand_segments(outputs, rows)
        _check_lengths(outputs, rows)
        _version_segments(outputs, rows)

    def assemble(self, outputs: list[AgentLoopOutput], rows: list[dict[str, Any]]) -> DataProto:
        """Pad trajectories into the batch layout described in the module docstring; the
        ``segments`` of a trajectory become rows after all the trajectories' own rows."""
        outputs, rows, segment = _expand_segments(outputs, rows)
        B = len(outputs)
        plen = np.fromiter((len(o.prompt_ids) for o in outputs), np.int64, B)
        rlen = np.fromiter((len(o.response_ids) for o in outputs), np.int64, B)
        _check_lengths(outputs, rows)
        seg_n, seg_v = _version_segments(outputs, rows)
        P, R = int(plen.max()), max(1, int(rlen.max()))
        n_p, n_r = int(plen.sum()), int(rlen.sum())
        # Built in numpy (a small group is ~70 groups a step: torch's per-op overhead was most
        # of the cost), one masked write per field in row-major order = concatenation order.
        pm = np.arange(P)[None, :] >= (P - plen)[:, None]  # left-padded prompts
        rm = np.arange(R)[None, :] < rlen[:, None]  # right-padded responses
        prompts = np.full((B, P), self.pad_id, dtype=np.int64)
        responses = np.full((B, R), self.pad_id, dtype=np.int64)
        response_mask = np.zeros((B, R), dtype=np.int64)
        logprobs = np.zeros((B, R), dtype=np.float32)
        versions = np.full((B, R), -1, dtype=np.int64)
        prompts[pm] = np.fromiter(chain.from_iterable(o.prompt_ids for o in outputs), np.int64, n_p)
        responses[rm] = np.fromiter(
            chain.from_iterable(o.response_ids for o in outputs), np.int64, n_r
        )
        response_mask[rm] = np.fromiter(
            chain.from_iterable(o.response_mask for o in outputs), np.int64, n_r
        )
        logprobs[rm] = np.fromiter(
            chain.from_iterable(o.response_logprobs for o in outputs), np.float32, n_r
        )
        versions[rm] = np.repeat(seg_v, seg_n)  # (sum rlen,) in row-major order
        known = versions >= 0  # (B, R)
        vmin = np.where(known, versions, np.iinfo(np.int64).max).min(1)  # (B,)
        vmin = np.where(known.any(1), vmin, -1)
        vmax = versions.max(1)  # (B,)
        attention_mask = np.concatenate([pm, rm], axis=1).astype(np.int64)
        position_ids = np.clip(attention_mask.cumsum(axis=1) - 1, 0, None) * attention_mask
        keep = (
            "uid",
            "sample_index",
            "data_source",
            "ground_truth",
            "extra_info",
            "messages",
            "index",
        )
        non_tensors: dict[str, Any] = {k: [r.get(k) for r in rows] for k in keep}
        non_tensors["num_turns"] = np.array([o.num_turns for o in outputs], dtype=np.int64)
        non_tensors["finish_reason"] = [o.finish_reason for o in outputs]
        non_tensors["agent_extra"] = [o.extra for o in outputs]
        non_tensors["agent_metrics"] = [o.metrics for o in outputs]
        non_tensors["segment"] = np.asarray(segment, dtype=np.int64)
        non_tensors["min_version"] = vmin
        non_tensors["max_version"] = vmax
        arrays = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": np.concatenate([prompts, responses], axis=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "rollout_log_probs": logprobs,
            "rollout_policy_version": versions,
        }
        return DataProto.from_dict({k: torch.from_numpy(v) for k, v in arrays.items()}, non_tensors)


def _expand_segments(
    outputs: list[AgentLoopOutput], rows: list[dict[str, Any]]
) -> tuple[list[AgentLoopOutput], list[dict[str, Any]], list[int]]:
    """Trajectories followed by the rows of their ``segments`` (each with its trajectory's row
    and ``agent_extra``), and the ``segment`` number of every row (0: a trajectory's own)."""
    if not any(o.segments for o in outputs):
        return outputs, rows, [0] * len(outputs)
    outs, rws, seg = list(outputs), list(rows), [0] * len(outputs)
    for o, r in zip(outputs, rows):
        for s, part in enumerate(o.segments, start=1):
            outs.append(replace(part, extra=o.extra, segments=[]))
            rws.append(r)
            seg.append(s)
    return outs, rws, seg


def _check_lengths(outputs: list[AgentLoopOutput], rows: list[dict[str, Any]]) -> None:
    """Raise, naming the trajectory, when its per-token fields differ in length."""
    for o, r in zip(outputs, rows):
        n = len(o.response_ids)
        if len(o.response_mask) != n or len(o.response_logprobs) != n:
            raise ValueError(
                f"trajectory {r.get('request_id')}: response_ids ({n}), response_mask "
                f"({len(o.response_mask)}) and response_logprobs ({len(o.response_logprobs)}) "
                "must have the same length"
            )


def _version_segments(
    outputs: list[AgentLoopOutput], rows: list[dict[str, Any]]
) -> tuple[np.ndarray, np.ndarray]:
    """All trajectories' ``(num_tokens, policy_version)`` segments, concatenated in row order:
    ``(counts (S,), versions (S,))``; a trajectory without versions is one segment of -1."""
    counts: list[int] = []
    values: list[int] = []
    for i, o in enumerate(outputs):
        n = len(o.response_ids)
        segs = o.response_versions if o.response_versions is not None else [(n, -1)]
        covered = sum(int(k) for k, _ in segs)
        if covered != n:
            raise ValueError(
                f"trajectory {rows[i].get('request_id')}: response_versions cover {covered} "
                f"tokens but response_ids has {n}: (num_tokens, version) segments must cover "
                "response_ids exactly"
            )
        counts += [int(k) for k, _ in segs]
        values += [int(v) for _, v in segs]
    return np.asarray(counts, dtype=np.int64), np.asarray(values, dtype=np.int64)
