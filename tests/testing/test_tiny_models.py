import pytest
import torch
from safetensors.torch import load_file

from postrl.testing import make_model, make_tokenizer


def test_tokenizer_is_byte_level_and_lossless():
    tok = make_tokenizer()
    text = "What is 12+34? ünïcødé ✓\n\t"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte, no merges
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_make_model_loads_with_transformers_and_generates(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_factory(arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert 2_000_000 <= n <= 3_000_000
    ids = tok("What is 1+2?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4) or out.shape[1] > ids.shape[1]


def test_same_seed_bit_identical(tmp_path):
    a = load_file(str(make_model(tmp_path / "a", seed=3) / "model.safetensors"))
    b = load_file(str(make_model(tmp_path / "b", seed=3) / "model.safetensors"))
    c = load_file(str(make_model(tmp_path / "c", seed=4) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
