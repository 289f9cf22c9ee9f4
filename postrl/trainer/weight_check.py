"""The weight-sync contract: every sync is verified before anything generated from it is trained.

After the fleet pushed a version (``rollout/fleet.py`` through the ``rollout.weight_sync``
backend), :class:`WeightContract` checks every live replica two ways:

1. **Transport**: the CRC-32 of every tensor as sent (``weights/verify.checksummed``) against
   the CRC-32 the replica recorded as it loaded it (``last_received``): a flipped byte, a dropped
   tensor or a half-finished update is named tensor by tensor.
2. **Function** (at the first sync, every ``rollout.verify_probe_every``-th after it, a replica's
   first sync and every resend): the replica generates a fixed probe (8 greedy tokens after 8
   fixed prompt tokens, ``ignore_eos``) and its log-probs are compared with the trainer's
   teacher-forced log-probs of the same tokens (``actor.compute_log_prob``, T = 1): a stale
   tied head or an engine that loaded the bytes into the wrong place shows up here. The
   tolerance is a fact of the backend's registry entry (``probe_atol`` per dtype; float32
   unless the trainer or the engine computes in a narrower dtype).

A failed check is pushed once more (same version); if it fails again the run stops with
:class:`~postrl.weights.verify.WeightSyncError` naming the engine and the tensors or probe tokens.
In ``sync`` and ``one_step_off`` the replicas generate nothing between the push and the check;
in ``fully_async`` a replica generates while it is checked, and a failure stops the run before
the next update trains. A sync (push and check) past ``rollout.weight_sync_timeout_s`` is a
:class:`~postrl.weights.verify.WeightSyncTimeoutError`. Metrics: ``weight_sync/verified`` (1
when the version in service passed), ``weight_sync/mismatch`` (failed checks this sync, 0 or
1), ``weight_sync/probed`` (replicas probed this sync), ``timing_s/weight_sync_verify`` (seconds
spent checking).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from postrl.protocol import DataProto
from postrl.rollout import SamplingParams
from postrl.rollout.checksum import PROBE_PREFIX
from postrl.weights.verify import (
    WeightSyncError,
    WeightSyncTimeoutError,
    checksummed,
    transport_mismatches,
)

__all__ = ["WeightContract", "contract_for", "probe_tolerance"]

logger = logging.getLogger(__name__)
PROBE_PROMPT_LEN, PROBE_NEW_TOKENS = 8, 8
# float32: 1e-2, not tighter. The probe prompt is arbitrary, and a trained model can be
# ill-conditioned on it: the W1 student after 654 steps of on-policy distillation gave probe
# token 6 a log-prob of -1.099841 in float64, -1.098758 (HF eager) / -1.098850 (SDPA, the
# trainer) / -1.101851 (the native engine) in float32 — three correct float32 forwards 3e-3
# apart — and a 1e-3 bound stopped that healthy run. What the probe is for (a tensor in the
# wrong place, a stale tied head, a corrupted tensor) moves log-probs by 0.1-10.
_DEFAULT_ATOL = {"float32": 1e-2, "bfloat16": 0.15, "float16": 0.05}


def probe_tolerance(backend: str, engine_dtype: str, trainer_dtype: str) -> float:
    """Largest |engine − trainer| log-prob a probe token may show: the backend's declared
    ``probe_atol`` for the narrower of the two dtypes (float32 where both are)."""
    from postrl.rollout import ROLLOUT_BACKENDS

    table = dict(_DEFAULT_ATOL, **(ROLLOUT_BACKENDS.meta(backend).get("probe_atol") or {}))
    narrow = [d for d in (engine_dtype, trainer_dtype) if d not in ("float32", "fp32")]
    return max((table.get(d, table["bfloat16"]) for d in narrow), default=table["float32"])


class WeightContract:
    """Verified syncs of one run's fleet (see the module docstring).

    Args:
        fleet: the run's :class:`~postrl.rollout.fleet.RolloutFleet`.
        actor: the actor worker group (``compute_log_prob``; ``world_size`` rows at least).
        run_async: runs a coroutine on the loop the replicas are driven from.
        engine: the backend's name (in errors).
        enabled: verify (``rollout.verify_weights``); off: push only, with the deadline.
        atol: probe tolerance (:func:`probe_tolerance`).
        vocab_size: probe token ids stay below it.
        timeout_s: deadline of one push (and of its check).
        probe_every: probe at sync 1, 1 + probe_every, ... (and a replica's first sync, and a
            resend); the checksums at every sync.
    """

    def __init__(
        self,
        fleet: Any,
        actor: Any,
        run_async: Callable[[Any], Any],
        *,
        engine: str,
        enabled: bool = True,
        atol: float = _DEFAULT_ATOL["float32"],
        vocab_size: int = 256,
        timeout_s: float = 600.0,
        probe_every: int = 1,
    ) -> None:
        self.fleet, self.actor, self.run_async = fleet, actor, run_async
        self.probe_every = max(1, int(probe_every))
        self.syncs = 0  # syncs verified so far
        self._probed: dict[int, Any] = {}  # id -> replica probed at least once (kept: no id reuse)
        self.engine, self.enabled, self.atol, self.timeout_s = engine, enabled, atol, timeout_s
        top = max(4, min(int(vocab_size), 4096))
        self.prompt = [3 + (7 * i + 5) % (top - 3) for i in range(PROBE_PROMPT_LEN)]

    def sync(self, open_source: Callable[[int], Any]) -> dict[str, float]:
        """Push the next version, verify it, resend once on a mismatch; the ``weights/*`` and
        ``weight_sync/*`` metrics."""
        verify_s, problems = 0.0, []
        due = self.syncs % self.probe_every == 0
        self.syncs += 1
        for attempt in range(2):
            expected: dict[str, int] = {}

            def source(v: int, exp: dict[str, int] = expected) -> Any:
                return checksummed(open_source(v), exp)

            push = self.fleet.sync_weights if attempt == 0 else self.fleet.resend
            metrics = self._deadline(lambda p=push, s=source: p(s), "push")
            if not self.enabled:
                return metrics
            t0 = time.perf_counter()
            # on this thread, the loop's (deadline inside); a resend is always probed
            problems, probed = self.check(expected, probe_all=due or attempt > 0)
            verify_s += time.perf_counter() - t0
            if not problems:
                return dict(
                    metrics,
                    **{
                        "weight_sync/verified": 1.0,
                        "weight_sync/mismatch": float(attempt),
                        "weight_sync/probed": float(probed),
                        "timing_s/weight_sync_verify": verify_s,
                    },
                )
            logger.warning(
                "weight sync v%d into %s failed verification (%s); resending once",
                self.fleet.version,
                self.engine,
                "; ".join(problems[:4]),
            )
        raise WeightSyncError(f"rollout backend {self.engine!r}", problems)

    def check(self, expected: dict[str, int], probe_all: bool = True) -> tuple[list[str], int]:
        """Every problem of every live replica — transport checksums, then the probe (of every
        serving replica with ``probe_all``, else of those never probed before) — and how many
        replicas were probed."""
        live = self.fleet.live
        problems: list[str] = []
        for r in live:
            received = getattr(r, "last_received", None)
            if received is not None:
                who = f"replica {getattr(r, 'replica_id', '?')}"
                problems += [f"{who}: {p}" for p in transport_mismatches(expected, received)]
        serving = [r for r in live if not getattr(r, "standby", False)]  # standby: no answers
        if not probe_all:
            serving = [r for r in serving if id(r) not in self._probed]
        problems += self.probe(serving)
        if not problems:
            self._probed.update((id(r), r) for r in serving)
        return problems, len(serving)

    def probe(self, replicas: list[Any]) -> list[str]:
        """Probe tokens whose engine log-prob differs from the trainer's by more than atol."""
        if not replicas:
            return []
        sp = SamplingParams(  # seeded: an engine draws nothing from a global generator
            temperature=0.0, max_new_tokens=PROBE_NEW_TOKENS, ignore_eos=True, seed=0
        )

        async def gen() -> list[Any]:
            import asyncio

            v = self.fleet.version
            calls = (
                r.generate(self.prompt, sp, f"{PROBE_PREFIX}v{v}-{i}")
                for i, r in enumerate(replicas)
            )
            try:
                return await asyncio.wait_for(asyncio.gather(*calls), self.timeout_s)
            except asyncio.TimeoutError as e:
                raise WeightSyncTimeoutError(
                    f"rollout backend {self.engine!r} (probe)", self.timeout_s
                ) from e

        self.fleet.wake_up()  # asleep since the update (sync modes); the next rollout wakes it
        outs = self.run_async(gen())
        ref = self._trainer_logprobs([o.token_ids for o in outs])
        problems = []
        for i, (r, o) in enumerate(zip(replicas, outs, strict=True)):
            got = torch.tensor(o.log_probs, dtype=torch.float32)
            n = min(len(got), len(o.token_ids))
            diff = (got[:n] - ref[i, :n]).abs()
            if n < PROBE_NEW_TOKENS or not bool((diff <= self.atol).all()):
                worst = int(diff.argmax()) if n else -1
                problems.append(
                    f"replica {getattr(r, 'replica_id', i)}: probe token {worst} log-prob "
                    f"{float(got[worst]) if n else float('nan'):.6f} vs trainer "
                    f"{float(ref[i, worst]) if n else float('nan'):.6f} "
                    f"(|Δ| {float(diff.max()) if n else float('inf'):.2e} > {self.atol:g}; "
                    f"{n}/{PROBE_NEW_TOKENS} tokens)"
                )
        return problems

    def _trainer_logprobs(self, responses: list[list[int]]) -> torch.Tensor:
        """(len(responses), R) teacher-forced log-probs at T = 1 from the actor."""
        R = PROBE_NEW_TOKENS
        rows = [list(t[:R]) + [0] * (R - len(t[:R])) for t in responses]
        ws = max(1, int(getattr(self.actor, "world_size", 1)))
        b = -(-len(rows) // ws) * ws  # whole rows for every dp rank
        rows += [rows[-1]] * (b - len(rows))
        resp = torch.tensor(rows, dtype=torch.long)  # (B, R)
        prompt = torch.tensor([self.prompt] * b, dtype=torch.long)  # (B, P)
        ids = torch.cat([prompt, resp], 1)  # (B, P + R)
        mask = torch.ones_like(ids)
        pos = torch.arange(ids.shape[1]).expand(b, -1).contiguous()
        data = DataProto.from_dict(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "position_ids": pos,
                "responses": resp,
                "response_mask": torch.ones_like(resp),
            },
            meta_info={"temperature": 1.0},
        )
        out = self.actor.compute_log_prob(data)
        return out.batch["old_log_probs"].float()[: len(responses)]

    def _deadline(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` in a helper thread, waited for up to ``timeout_s``."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = fn()
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                box["err"] = e

        t = threading.Thread(target=run, name=f"postrl-weight-{what}", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            raise WeightSyncTimeoutError(
                f"rollout backend {self.engine!r} ({what})", self.timeout_s
            )
        if "err" in box:
            raise box["err"]
        return box["out"]


def contract_for(ctx: Any) -> WeightContract:
    """The run's :class:`WeightContract` (built on first use from the context's config, fleet,
    actor and event loop; kept on the context)."""
    wc = ctx.__dict__.get("_weight_contract")
    if wc is None:
        cfg = ctx.cfg
        r, m = cfg.rollout, cfg.model
        engine_dtype = str({**ctx.rollout_options, **r.engine_kwargs}.get("dtype", "float32"))
        trainer_dtype = m.compute_dtype
        if trainer_dtype == "auto":
            trainer_dtype = "float32" if cfg.trainer.device == "cpu" else "bfloat16"
        wc = ctx.__dict__["_weight_contract"] = WeightContract(
            ctx.fleet,
            ctx.actor,
            ctx.run_async,
            engine=r.backend,
            enabled=r.verify_weights,
            atol=probe_tolerance(r.backend, engine_dtype, trainer_dtype),
            vocab_size=len(ctx.tokenizer),
            timeout_s=r.weight_sync_timeout_s,
            # deterministic runs probe every sync: the probe turns the event loop (delivering
            # the paused requests' partial outputs) at a fixed point of the reproduced schedule,
            # so a resumed run must probe where the uninterrupted one did
            probe_every=1 if cfg.trainer.deterministic else r.verify_probe_every,
        )
    return wc
