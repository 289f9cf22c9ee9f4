"""``trainer.flush_denormal``: the trainer's process flushes fp32 denormals to zero (x86
FTZ/DAZ) before its first torch op, or keeps IEEE gradual underflow when it is off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys, torch
from postrl.config import load_config
from postrl.trainer import RLTrainer
trainer = RLTrainer(load_config(None, json.loads(sys.argv[1])))
try:
    # 1e-39 is a denormal: DAZ reads it as 0, FTZ writes a denormal result as 0; a tensor large
    # enough that the multiply runs on every OpenMP thread
    x = torch.full((1 << 20,), 1e-39) * 1.0
    print(json.dumps({"nonzero": int(x.count_nonzero()), "one": float(x[:1])}))
finally:
    trainer.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flush", [True, False])
def test_flush_denormal_is_set_in_the_trainer_process(small_overrides, flush):
    args = [*small_overrides, "trainer.num_threads=2", f"trainer.flush_denormal={flush}"]
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if flush:
        assert got == {"nonzero": 0, "one": 0.0}
    else:
        assert got["nonzero"] == 1 << 20 and got["one"] == pytest.approx(1e-39)
