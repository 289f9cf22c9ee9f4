"""What a run promises about bit-for-bit reproducibility, written into ``run_info.json``.

**The promise (CPU, the defaults).** Two runs with the same config and seed, on the same machine
(same CPU model, so the same BLAS kernels), with the same ``trainer.num_threads`` and the same
package versions, write the same ``metrics.jsonl`` rows (wall-clock ``timing_s/*``, ``perf/*``
aside) and the same weights, bit for bit; so does a run SIGKILLed at any point and resumed from
its last checkpoint. Tested at 1 and 2 threads (``tests/trainer/test_determinism.py``,
``tests/trainer/test_resume.py``).

**Why it holds.** Sampling is counter-based (a token depends on its seed, position and logits
only). Every CPU reduction on the default path has an order fixed by the shapes and the thread
count: torch's ``parallel_for`` splits statically by thread count; MKL's ``sgemm`` is run-to-run
reproducible at a fixed thread count and alignment (torch allocates 64-byte aligned buffers);
the native engine's C kernels are row-local with static splits and no atomics or cross-thread
reductions (``rollout/native/kernels.py``). One op broke it (issue 15): the backward of advanced
indexing, ``index_put_(accumulate=True)``, adds with *atomic* float adds over the threads when
more than one thread runs and the update has ≥ 32768 elements — a race whose order (and so the
last bits of the sum) changes run to run wherever indices repeat. With prefix sharing the
hidden state that predicts each response's first token is the prompt's last one, shared by the
``n`` responses: two 2-thread runs drifted apart after 5–10 steps. ``engine/logprob.py`` now
gathers with ``index_select`` (backward ``index_add_``: serial over indices, deterministic and
faster), and a test repeats the packed backward at 2 threads bit for bit.

**Not promised** (listed per run by :func:`determinism_info`): across thread counts (the split
of every parallel reduction changes), across CPU models or ISAs (MKL and the kernels pick code
per ISA; ``MKL_CBWR=COMPATIBLE`` would pin MKL at a large speed cost and is not set), across
package versions; GPU training (cuBLAS split-K, atomics in scatter/index backward and SDPA are
nondeterministic unless ``torch.use_deterministic_algorithms(True)`` and
``CUBLAS_WORKSPACE_CONFIG`` are set, which postrl does not do by default); vLLM / SGLang rollouts
(batch-dependent GPU kernels); several rollout replicas or the Ray backend, where requests are
routed by live load, so which batch decodes a sequence — and hence the last bits of its
logits — may vary.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_model", "determinism_info"]

_SCOPE = (
    "bit for bit across runs and across kill-and-resume on the same machine (CPU model), with "
    "the same trainer.num_threads and package versions"
)


def cpu_model() -> str:
    """This CPU's ``model name`` from ``/proc/cpuinfo`` (the platform's processor name where
    there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _caveats(cfg: Any) -> list[str]:
    """Why this configuration falls outside the promise, one reason per entry (empty: inside)."""
    t, r = cfg.trainer, cfg.rollout
    out = []
    if t.device != "cpu":
        out.append(
            f"trainer.device={t.device}: GPU kernels (cuBLAS split-K, atomic adds in "
            "scatter/index backward, SDPA backward) are not deterministic; postrl does not set "
            "torch.use_deterministic_algorithms / CUBLAS_WORKSPACE_CONFIG"
        )
    if r.backend not in ("native", "hf"):
        out.append(
            f"rollout.backend={r.backend}: the engine's GPU kernels depend on batch composition "
            "and are not deterministic; sampled tokens may differ run to run"
        )
    if r.num_replicas > 1 or t.backend != "local":
        out.append(
            f"rollout.num_replicas={r.num_replicas}, trainer.backend={t.backend}: requests are "
            "routed by live load, so a sequence's decode batch (and the last bits of its "
            "rollout log-probs) may vary"
        )
    if t.num_threads <= 0:
        out.append(
            "trainer.num_threads=0: the thread count comes from the environment "
            "(OMP_NUM_THREADS, else the machine's cores), not the config; the promise holds "
            "only at the same count — set trainer.num_threads to pin it"
        )
    return out


def determinism_info(cfg: Any) -> dict[str, Any]:
    """The reproducibility promise of a run with config ``cfg`` (a validated ``PostRLConfig``),
    as a JSON-able dict for ``run_info.json``.

    Keys: ``bitwise_reproducible`` (True when no caveat applies), ``scope`` (what the promise
    covers), ``caveats`` (why not, each naming its config key), and what the promise is relative
    to: ``num_threads`` (torch's intra-op threads now), ``cpu``, ``cpu_capability`` (the ISA
    torch dispatches to), ``blas``, ``mkl_cbwr`` (``$MKL_CBWR`` or None),
    ``torch_deterministic_algorithms``.
    """
    caveats = _caveats(cfg)
    return {
        "bitwise_reproducible": not caveats,
        "scope": _SCOPE,
        "caveats": caveats,
        "num_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": "mkl" if torch.backends.mkl.is_available() else "other",
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
