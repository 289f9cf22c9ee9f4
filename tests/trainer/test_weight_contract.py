"""The weight-sync contract: every sync verified (checksums as sent vs as loaded, a probe's
log-probs engine vs trainer); a sync corrupted once in transit is caught and resent (the run
recovers and its metrics count the mismatch); one corrupted on every try stops the run naming the
tensor and the engine — for the ``native`` and ``hf`` backends here, ``vllm`` in
``test_vllm_train.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_helpers import metric_rows

from postrl.data import generate_addition, write_parquet
from postrl.rollout.checksum import ReceivedWeights
from postrl.weights import FrameStream, encode_frame, pack_buckets
from postrl.weights.verify import TRANSPORT_FAULTS, checksummed, transport_mismatches

CORRUPTED = "model.embed_tokens.weight"  # the first tensor of the actor's stream


def test_checksums_name_a_flipped_byte_a_dropped_and_an_extra_tensor():
    """Sent vs received manifests, for a tensor stream and for bucket frames: equal when the
    bytes are; a flipped byte, a missing and an unexpected tensor are each named."""
    g = torch.Generator().manual_seed(0)
    w = {f"w{i}": torch.randn(64, 8, generator=g) for i in range(5)}
    sent: dict[str, int] = {}
    rec = ReceivedWeights()
    rec.begin()
    list(rec.track(checksummed(iter(w.items()), sent)))
    rec.end()
    assert set(sent) == set(w) and transport_mismatches(sent, rec.last) == []
    frames: dict[str, int] = {}
    stream = FrameStream(encode_frame(b) for b in pack_buckets(iter(w.items()), 1 << 10))
    for _ in checksummed(stream, frames).frames:
        pass
    assert frames == sent  # the same CRC-32 from the frame bytes as from the tensors
    bad = dict(rec.last)
    flipped = w["w2"].clone()
    flipped.view(torch.uint8).view(-1)[5] ^= 1  # one bit of one byte
    r2 = ReceivedWeights()
    r2.begin()
    list(r2.track([("w2", flipped)]))
    r2.end()
    bad["w2"] = r2.last["w2"]
    del bad["w4"]
    bad["extra"] = 1
    problems = transport_mismatches(sent, bad)
    assert len(problems) == 3
    assert any("'w2'" in p and "checksum" in p for p in problems)
    assert any("'w4'" in p and "never loaded" in p for p in problems)
    assert any("'extra'" in p and "never sent" in p for p in problems)


def test_a_transport_fault_changes_what_arrives_not_what_was_checksummed():
    sent: dict[str, int] = {}
    t = torch.ones(4)
    TRANSPORT_FAULTS.append(lambda n, x: x + 1)
    try:
        out = list(checksummed([("a", t)], sent))
    finally:
        TRANSPORT_FAULTS.clear()
    rec = ReceivedWeights()
    list(rec.track(out))
    rec.end()
    assert transport_mismatches(sent, rec.last) == [
        f"tensor 'a': checksum {rec.last['a']:08x} received, {sent['a']:08x} sent"
    ]


@pytest.fixture(scope="module")
def contract_setup(tiny_model_dir, tmp_path_factory, digits_reward):
    d = tmp_path_factory.mktemp("contract")
    train = write_parquet(generate_addition(8, seed=3), d / "train.parquet")
    base = [
        f"model.path={tiny_model_dir}",
        f"data.train_files=[{train}]",
        "data.train_batch_size=2",
        "data.max_prompt_length=48",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-3",
        "rollout.n=2",
        "rollout.response_length=4",
        "trainer.total_steps=2",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]",
        f"reward.custom_function.path={digits_reward}",
    ]
    return base, d


def corrupt_run(args: list[str], flag: str, step: int, timeout: float = 900):
    """``faults_run FLAG STEP train ARGS`` in a subprocess (1 thread)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "postrl.testing.faults_run", flag, str(step), "train", *args]
    cmd.append("trainer.num_threads=1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_corrupted_sync_is_resent_once_and_fatal_when_it_persists(contract_setup, backend):
    """Once after step 1: the run completes, step 1's sync counts one mismatch, every sync is
    verified. On every try after step 1: the run exits non-zero naming the tensor and the
    engine, before step 1's metrics are logged."""
    base, d = contract_setup
    run = d / f"{backend}-once"
    args = [*base, f"rollout.backend={backend}", f"trainer.run_dir={run}"]
    p = corrupt_run(args, "--corrupt-sync", 1)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metric_rows(run)
    assert [r["weight_sync/verified"] for r in rows] == [1.0, 1.0]
    assert [r["weight_sync/mismatch"] for r in rows] == [1.0, 0.0]
    raw = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["timing_s/weight_sync_verify"] > 0 for r in raw)  # (wall clock: not in rows)
    run = d / f"{backend}-always"
    args = [*base, f"rollout.backend={backend}", f"trainer.run_dir={run}"]
    p = corrupt_run(args, "--corrupt-sync-always", 1)
    assert p.returncode not in (0, 3), p.stderr[-3000:]
    assert "WeightSyncError" in p.stderr and CORRUPTED in p.stderr, p.stderr[-3000:]
    assert f"rollout backend '{backend}'" in p.stderr
    assert "probe token" in p.stderr  # the functional check fails too
    assert not (run / "metrics.jsonl").exists() or metric_rows(run) == []


def test_probe_tolerance_by_dtype():
    """float32: 1e-2 (three correct float32 forwards of a trained student disagreed by 3e-3 on
    one probe token, docs/rollout.md); the narrower dtype of trainer and engine decides."""
    from postrl.trainer.weight_check import probe_tolerance

    assert probe_tolerance("native", "float32", "float32") == pytest.approx(1e-2)
    assert probe_tolerance("native", "bfloat16", "float32") == pytest.approx(0.15)
    assert probe_tolerance("hf", "float32", "float16") == pytest.approx(0.05)


def test_probe_runs_at_the_first_sync_then_every_nth(contract_setup):
    """``rollout.verify_probe_every=2``: the probe at the run's first sync (the initial weights,
    before step 1) and every second after it — after steps 2, 4, ... (the checksums at every
    sync); with 1 at every sync."""
    from postrl.trainer.run import train_main

    base, d = contract_setup
    for every, expected in ((2, [0.0, 1.0, 0.0]), (1, [1.0, 1.0, 1.0])):
        run = d / f"probe-every-{every}"
        over = ["trainer.total_steps=3", f"rollout.verify_probe_every={every}"]
        assert train_main(None, [*base, *over, f"trainer.run_dir={run}"]) == 0
        rows = metric_rows(run)
        assert [r["weight_sync/probed"] for r in rows] == expected
        assert all(r["weight_sync/verified"] == 1.0 for r in rows)
