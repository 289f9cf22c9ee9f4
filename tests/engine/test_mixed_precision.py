"""Mixed precision in the training engine: fp32 master weights, bf16 math (``model.compute_dtype``).

Unsharded models run their forward under ``torch.autocast``; FSDP2 units use a
``MixedPrecisionPolicy`` (tested on dp=2 gloo workers in ``test_fsdp.py``). bf16 matmuls run on
CPU too, so both paths are exercised here without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from postrl.config import ConfigError, load_config, validate_config
from postrl.engine.model import ModelSpec as ModelConfig
from postrl.engine.model import load_critic, load_policy, resolve_dtypes

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize(
    ("dtype", "compute", "device", "trainable", "want"),
    [
        ("auto", "auto", "cpu", True, (F32, F32)),  # the CPU default: no mixed precision
        (
            "auto",
            "auto",
            "cuda",
            True,
            (F32, BF16),
        ),  # GPU: fp32 master weights, bf16 math (verl's FSDP default)
        ("auto", "auto", "cuda", False, (BF16, BF16)),  # frozen reference: no master copy needed
        ("auto", "bfloat16", "cpu", True, (F32, BF16)),
        ("bfloat16", "auto", "cpu", True, (BF16, BF16)),  # explicit 16-bit storage computes in it
        ("float16", "auto", "cuda", True, (F16, F16)),
        ("float32", "float32", "cuda", True, (F32, F32)),
    ],
)
def test_resolve_dtypes(dtype, compute, device, trainable, want):
    cfg = ModelConfig(path="x", dtype=dtype, compute_dtype=compute)
    assert resolve_dtypes(cfg, device, trainable=trainable) == want


@pytest.mark.parametrize(
    ("dtype", "compute", "match", "engine_rejects"),
    [
        ("auto", "float16", "loss scaling", True),
        ("bfloat16", "float32", "wider than model.dtype=bfloat16", False),
        ("float16", "bfloat16", "two different 16-bit formats", False),
        ("fp32", "auto", "model.dtype='fp32' is not one of", True),
    ],
)
def test_bad_dtypes_are_rejected_at_startup(tiny_model_dir, dtype, compute, match, engine_rejects):
    """Config validation rejects every bad combination; the engine itself rejects what it cannot
    run (unknown names, float16 compute without loss scaling)."""
    if engine_rejects:
        with pytest.raises(ValueError, match=match):
            resolve_dtypes(ModelConfig(path="x", dtype=dtype, compute_dtype=compute), "cpu")
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "data.train_files=[x.parquet]",
            f"model.dtype={dtype}",
            f"model.compute_dtype={compute}",
        ],
    )
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, check_files=False)


def _linear_output_dtypes(module: nn.Module) -> tuple[set[torch.dtype], list]:
    seen: set[torch.dtype] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
        for m in module.modules()
        if isinstance(m, nn.Linear)
    ]
    return seen, hooks


def test_policy_autocast_keeps_fp32_master_weights(tiny_model_dir, make_batch):
    """compute_dtype=bfloat16 on an unsharded policy: the decoder's matmuls run in bf16, the
    log-probs come back fp32 and close to the fp32 model's, gradients and weights stay fp32, and
    an optimizer step moves the fp32 weights."""
    torch.manual_seed(0)
    b = make_batch(num_prompts=2, n=4, seed=5)
    R = b.batch["responses"].shape[1]
    ids, am = b.batch["input_ids"], b.batch["attention_mask"]
    ref = load_policy(ModelConfig(path=str(tiny_model_dir)), "cpu")
    mixed = load_policy(ModelConfig(path=str(tiny_model_dir), compute_dtype="bfloat16"), "cpu")
    assert ref.compute_dtype is None and mixed.compute_dtype is BF16
    assert all(p.dtype == F32 for p in mixed.module.parameters())
    with torch.no_grad():
        lp_ref, _ = ref.logprobs(ids, am, R)
    seen, hooks = _linear_output_dtypes(mixed.module)
    lp, ent = mixed.logprobs(ids, am, R, calculate_entropy=True, share_prefix=True)
    for h in hooks:
        h.remove()
    assert BF16 in seen, f"no bf16 matmul ran under compute_dtype=bfloat16 (linear outputs: {seen})"
    assert lp.dtype == F32 and ent.dtype == F32
    mask = b.batch["response_mask"].bool()
    err = (lp - lp_ref)[mask].abs().max().item()
    assert 1e-4 < err < 0.1, (
        f"bf16 log-probs should be close to, not equal to, fp32 ones (max |diff| {err})"
    )
    (lp[mask].sum() + 0.01 * ent[mask].sum()).backward()
    grads = [p.grad for p in mixed.trainable_parameters()]
    assert all(g is not None and g.dtype == F32 for g in grads)
    before = {n: p.detach().clone() for n, p in mixed.module.named_parameters()}
    torch.optim.AdamW(list(mixed.trainable_parameters()), lr=1e-3).step()
    moved = max(
        (p.detach() - before[n]).abs().max().item() for n, p in mixed.module.named_parameters()
    )
    assert moved > 1e-4
    assert all(p.dtype == F32 for p in mixed.module.parameters())


def test_critic_autocast_values_fp32(tiny_model_dir, make_batch):
    b = make_batch(num_prompts=2, n=2, seed=6)
    R = b.batch["responses"].shape[1]
    critic = load_critic(ModelConfig(path=str(tiny_model_dir), compute_dtype="bfloat16"), "cpu")
    assert critic.autocast_dtype is BF16 and critic.value_head.weight.dtype == F32
    nn.init.normal_(
        critic.value_head.weight
    )  # the head starts at zero; make the values non-trivial
    seen, hooks = _linear_output_dtypes(critic.backbone)
    v = critic(b.batch["input_ids"], b.batch["attention_mask"], R)
    for h in hooks:
        h.remove()
    assert BF16 in seen and v.dtype == F32
    v.sum().backward()
    assert critic.value_head.weight.grad.dtype == F32
