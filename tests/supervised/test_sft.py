"""SFT lowers the loss on a tiny dataset, masks only assistant tokens, and writes an HF model."""

from __future__ import annotations

import math

import pytest
import torch

from postrl.config import ConfigError
from postrl.config.supervised import SFTConfig
from postrl.data.tasks import generate_addition, sft_rows_from_rl_rows, write_parquet
from postrl.supervised.common import parse_options, warmup_cosine_scheduler
from postrl.supervised.sft import run_sft, sft_main, tokenize_rows
from postrl.testing import make_tokenizer


def test_assistant_mask_covers_only_the_answer():
    tok = make_tokenizer()
    rows = [{"prompt": "1+2?", "response": "3"}]
    ((ids, mask),) = tokenize_rows(tok, rows, 512)
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "3<|im_end|>\n" or masked == "3<|im_end|>"


def test_sft_lowers_loss_and_writes_hf(tiny_model_dir, tmp_path):
    rows = sft_rows_from_rl_rows(generate_addition(24, seed=0))
    f = write_parquet(rows, tmp_path / "sft.parquet")
    m = run_sft(
        str(tiny_model_dir),
        str(f),
        str(tmp_path / "out"),
        epochs=4,
        lr=3e-3,
        batch_tokens=256,
        warmup_steps=2,
        log_every=0,
    )
    assert m["sft/final_loss"] < 0.7 * m["sft/first_loss"], m
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert (
        sft_main(
            [
                f"model_path={tiny_model_dir}",
                f"train_file={f}",
                f"out_dir={tmp_path / 'o2'}",
                "max_steps=2",
                "log_every=0",
            ]
        )
        == 0
    )


def test_target_loss_trains_on_past_max_steps_until_it_is_met(tiny_model_dir, tmp_path):
    """``target_loss``: a run above it at ``max_steps`` trains on (at most
    ``target_extra_steps``); a run at or below it stops at ``max_steps`` as before."""
    f = write_parquet(sft_rows_from_rl_rows(generate_addition(24, seed=0)), tmp_path / "s.parquet")

    def sft(out: str, **kw):
        kw = dict(epochs=20, lr=3e-3, batch_tokens=256, warmup_steps=1, log_every=0, **kw)
        return run_sft(str(tiny_model_dir), str(f), str(tmp_path / out), **kw)

    unreachable = sft("a", max_steps=3, target_loss=1e-6, target_extra_steps=4)
    assert (unreachable["sft/steps"], unreachable["sft/extra_steps"]) == (7, 4)
    met = sft("b", max_steps=3, target_loss=100.0)
    assert (met["sft/steps"], met["sft/extra_steps"]) == (3, 0)
    # a reachable target stops the extra steps as soon as the last 10 losses' mean is at it
    goal = sft("c", max_steps=12)["sft/final_loss"]  # the mean of steps 3-12
    reached = sft("d", max_steps=3, target_loss=goal, target_extra_steps=50)
    assert 0 < reached["sft/extra_steps"] < 50 and reached["sft/final_loss"] <= goal, reached


def test_sft_options_report_every_problem_at_once(tmp_path):
    """``postrl sft`` options load through config/loader: one error lists the misspelt key (with
    its did-you-mean), the badly typed value and the missing required fields."""
    with pytest.raises(ConfigError) as e:
        parse_options(["epoch=2", "lr=fast", "train_file=x.parquet"], SFTConfig, "sft")
    msg = str(e.value)
    assert "4 problem(s)" in msg, msg
    assert "did you mean 'epochs'" in msg
    assert "lr: expected a number, got 'fast'" in msg
    assert "model_path: required" in msg and "out_dir: required" in msg
    assert "train_file: required" not in msg
    y = tmp_path / "sft.yaml"
    y.write_text("sft:\n  model_path: m\n  train_file: t.parquet\n  out_dir: o\n  lr: 3.0e-3\n")
    opts = parse_options([str(y), "epochs=3"], SFTConfig, "sft")
    assert (opts.model_path, opts.lr, opts.epochs, opts.batch_tokens) == ("m", 3e-3, 3, 2048)


def test_supervised_schedule_is_the_engine_schedule():
    """warmup 2, total 6: factors (s+1)/2 while warming up, then 0.1 + 0.9·½(1 + cos(π(s−2)/4))."""

    def factors(warmup, total, n):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=1.0)
        sched = warmup_cosine_scheduler(opt, 1.0, warmup, total)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    c = 0.5 * (1 + math.cos(math.pi / 4))  # 0.853553
    want = [0.5, 1.0, 1.0, 0.1 + 0.9 * c, 0.55, 0.1 + 0.9 * (1 - c), 0.1]
    assert factors(2, 6, 7) == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert factors(10, 3, 3) == pytest.approx([0.1, 0.2, 0.3], rel=1e-12)  # never leaves warmup
