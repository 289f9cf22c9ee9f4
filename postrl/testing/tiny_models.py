"""Tiny Hugging Face models and a byte-level tokenizer, created locally (nothing is downloaded).

``make_model(out_dir, preset="tiny", arch="qwen2", seed=0)`` writes an ordinary HF model
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``
with a ChatML chat template, ``generation_config.json``) that ``AutoModelForCausalLM`` and
``AutoTokenizer.from_pretrained`` load unchanged.

The tokenizer is byte-level BPE with an empty merge list: one token per byte (so any text is
representable and token ids are easy to reason about in tests) plus the special tokens
``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>``, and — like Qwen2.5/Qwen3 — the tool tags
``<tool_call>``, ``</tool_call>``, ``<tool_response>`` and ``</tool_response>`` as single
**non-special** added tokens (``decode(..., skip_special_tokens=True)`` keeps them, so tool-call
parsers see them in decoded text). The vocabulary is 263 tokens, padded to 264 in the model, the
same embedding shape as before the tool tags were added; byte and special ids are unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = [
    "PRESETS",
    "ARCHS",
    "CHATML_TEMPLATE",
    "SPECIAL_TOKENS",
    "TOOL_TOKENS",
    "make_tokenizer",
    "make_model",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Tool tags added as single, non-special tokens (ids 259-262), as in Qwen2.5/Qwen3 tokenizers.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# ChatML, as used by Qwen. Tool messages are rendered as a user turn wrapped in
# <tool_response> tags (Qwen2.5 convention); the generation prompt opens an assistant turn.
# With ``tools`` the schemas open the conversation in a system turn (merged with a leading
# system message) as in Qwen2.5, but compact: ``<tools>\n{schema}\n...\n</tools>`` without
# Qwen's instructions (a byte-level tiny model pays a token per byte). An assistant message's
# ``tool_calls`` follow its content as Hermes ``<tool_call>\n{"name": ..., "arguments": ...}
# \n</tool_call>`` blocks (the text the model samples); a ``None`` content renders as empty.
# Without tools and tool_calls the rendering is the plain ChatML one of before, byte for byte.
CHATML_TEMPLATE = (
    "{%- set ns = namespace(skip_first=false) %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- (messages[0]['content'] or '') + '\\n\\n' }}"
    "{%- set ns.skip_first = true %}"
    "{%- endif %}"
    "{{- '<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and ns.skip_first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + (message['content'] or '') "
    "+ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: preset -> architecture sizes (≈2.4M params for tiny, ≈25M for small).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}
ARCHS = ("qwen2", "llama", "qwen3")


def make_tokenizer():
    """Byte-level BPE tokenizer (no merges: one token per byte) with ChatML special tokens and the
    tool tags of :data:`TOOL_TOKENS` as single non-special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.model_max_length = 4096
    return fast


def _config(preset: str, arch: str, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import AutoConfig

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {list(ARCHS)}")
    sizes = dict(PRESETS[preset])
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=(preset == "tiny"),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        **sizes,
    )
    if arch == "qwen3":
        common["head_dim"] = sizes["hidden_size"] // sizes["num_attention_heads"]
    if arch == "llama":
        common["attention_bias"] = False
    return AutoConfig.for_model(arch, **common)


def make_model(
    out_dir: str | Path,
    preset: str = "tiny",
    arch: str = "qwen2",
    seed: int = 0,
    head: str = "causal_lm",
) -> Path:
    """Write a randomly initialised HF model + tokenizer to ``out_dir`` and return the path.

    ``head="reward"`` writes a ``*ForSequenceClassification`` model with one label (a reward
    model for ``reward.model.path``) instead of a causal LM. Same ``seed`` → bit-identical
    weights (initialisation runs on CPU in fp32 under a fixed generator).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        GenerationConfig,
    )

    if head not in ("causal_lm", "reward"):
        raise ValueError(f"head={head!r} must be 'causal_lm' or 'reward'")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    n_tok = len(tok)
    vocab_size = (n_tok + 7) // 8 * 8  # pad the embedding to a multiple of 8
    eos_id = tok.convert_tokens_to_ids("<|im_end|>")
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = _config(preset, arch, vocab_size, eos_id, pad_id)
    cfg.initializer_range = 0.02
    torch.manual_seed(seed)
    if head == "reward":
        cfg.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Deterministic re-init, independent of transformers' init order.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=eos_id).save_pretrained(
        out
    )
    (out / "postrl_model.json").write_text(
        json.dumps({"preset": preset, "arch": arch, "seed": seed, "head": head})
    )
    return out
