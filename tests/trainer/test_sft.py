"""SFT lowers the loss on a tiny dataset, masks only assistant tokens, and writes an HF model."""

from __future__ import annotations

from postrl.data.tasks import generate_addition, sft_rows_from_rl_rows, write_parquet
from postrl.engine.sft import run_sft, sft_main, tokenize_rows
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
