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
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
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


def test_tool_tags_are_single_non_special_tokens_that_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from postrl.testing.tiny_models import TOOL_TOKENS
    from postrl.tools import get_tool_parser

    make_tokenizer().save_pretrained(tmp_path)
    for tok in (make_tokenizer(), AutoTokenizer.from_pretrained(tmp_path)):
        ids = [tok.convert_tokens_to_ids(t) for t in TOOL_TOKENS]
        assert ids == [259, 260, 261, 262]
        assert not set(TOOL_TOKENS) & set(tok.all_special_tokens)
        text = (
            'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}'
            "\n</tool_call>"
        )
        enc = tok(text, add_special_tokens=False)["input_ids"]
        assert enc[3] == ids[0] and enc[-1] == ids[1]
        assert len(enc) == len(text.encode()) - len("<tool_call>") - len("</tool_call>") + 2
        # skip_special_tokens drops <|im_end|> but keeps the tool tags, so the parser sees the call
        decoded = tok.decode(enc + [tok.eos_token_id], skip_special_tokens=True)
        assert decoded == text
        parsed = get_tool_parser("hermes").parse(decoded)
        assert [(c.name, c.arguments) for c in parsed.calls] == [
            ("calculator", {"expression": "2*3"})
        ]
        assert not parsed.errors
        chat = tok.apply_chat_template([{"role": "tool", "content": "6"}], tokenize=False)
        chat_ids = tok(chat, add_special_tokens=False)["input_ids"]
        assert ids[2] in chat_ids and ids[3] in chat_ids and tok.decode(chat_ids) == chat


def test_tool_tags_keep_the_model_and_other_ids_unchanged(tmp_path):
    tok = make_tokenizer()
    assert len(tok) == 263
    # bytes and ChatML specials keep the ids they had before the tool tags were added
    assert tok("a\n", add_special_tokens=False)["input_ids"] == [64, 198]
    assert [
        tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    ] == [256, 257, 258]
    weights = load_file(str(make_model(tmp_path / "m") / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (264, 256)
