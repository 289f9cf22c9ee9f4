"""RoPE scaling configs: the native engine matches transformers greedy output and log-probs."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from postrl.rollout import SamplingParams, create_rollout_backend

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rope_scaling_matches_transformers(tiny_model_factory, tmp_path, kind):
    from transformers import AutoModelForCausalLM

    d = tmp_path / kind
    shutil.copytree(tiny_model_factory("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": 10000.0, **SCALINGS[kind]}
    (d / "config.json").write_text(json.dumps(cfg))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    be = create_rollout_backend("native", d, max_num_seqs=2, max_model_len=128)
    prompt = list(range(40, 80))
    out = asyncio.run(
        be.generate(prompt, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True), "r")
    )
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == out.token_ids
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
    assert (ref - torch.tensor(out.log_probs)).abs().max().item() < 1e-4
