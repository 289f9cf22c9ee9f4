"""Route a Hugging Face decoder's small training ops through postrl's fused CPU kernels.

:func:`install` swaps, in place, the class of each module it recognises for a subclass whose
``forward`` calls :mod:`postrl.kernels.train` when the inputs are float32 CPU tensors, and the
original ``forward`` otherwise (bf16 autocast, GPU, …), so a model stays valid for every path:

* RMSNorm (``Qwen2RMSNorm``, ``Qwen3RMSNorm``, ``LlamaRMSNorm``, ``MistralRMSNorm``: the formula
  ``w · x / sqrt(mean(x²) + eps)``) → :func:`~postrl.kernels.train.rms_norm`;
* the gated MLP (``Qwen2MLP``, ``Qwen3MLP``, ``LlamaMLP``, ``MistralMLP`` with SiLU:
  ``down(silu(gate(x)) · up(x))``) → the projections stay ``nn.Linear`` (LoRA adapters on them
  keep working), the activation is :func:`~postrl.kernels.train.swiglu`;
* the attention modules are marked so that :func:`postrl.engine.varlen.varlen_attention` runs
  :func:`~postrl.kernels.train.packed_attention` on the packed layout;
* their modeling module's ``apply_rotary_pos_emb`` (a module-level function the attention's
  ``forward`` looks up, as Liger-Kernel patches it) is wrapped: called from a fused attention
  module's ``forward`` with fp32 CPU inputs it runs :func:`~postrl.kernels.train.rope`, written
  token-major as the packed attention reads it; any other call (another model in the process,
  ``model.kernels=torch``, another dtype or device, extra arguments) goes to the original.

Only classes whose formula is known to be these are touched (an allowlist by class name); any
other model trains on torch's ops unchanged. Parameter names, ``state_dict`` and checkpoints are
unchanged: only the class of the module object changes.
"""

from __future__ import annotations

import contextvars
import logging
import sys

import torch
from torch import nn

from postrl.engine.varlen import FUSED_ATTENTION
from postrl.kernels import train as kernels

__all__ = ["install"]

logger = logging.getLogger(__name__)

_NORMS = {"Qwen2RMSNorm", "Qwen3RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"}
_MLPS = {"Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP"}
_SILUS = {"SiLU", "SiLUActivation"}
_ATTENTIONS = {"Qwen2Attention", "Qwen3Attention", "LlamaAttention", "MistralAttention"}
_subclasses: dict[type, type] = {}
_IN_FUSED_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "postrl_fused_attention", default=False
)


def _fp32_cpu(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _fp32_cpu(hidden_states, self.weight) and not torch.is_autocast_enabled("cpu"):
        return kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(hidden_states)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    if _fp32_cpu(x) and not torch.is_autocast_enabled("cpu"):
        a, u = self.gate_proj(x), self.up_proj(x)
        if _fp32_cpu(a, u):
            return self.down_proj(kernels.swiglu(a, u))
        return self.down_proj(self.act_fn(a) * u)
    return super(type(self), self).forward(x)


def _attention_forward(self, *args, **kwargs):
    token = _IN_FUSED_ATTENTION.set(True)
    try:
        return super(type(self), self).forward(*args, **kwargs)
    finally:
        _IN_FUSED_ATTENTION.reset(token)


def _fused_rope(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (
            _IN_FUSED_ATTENTION.get()
            and not args
            and kwargs.get("unsqueeze_dim", 1) == 1
            and q.dim() == 4
            and q.shape[0] == 1
            and cos.dim() == 3
            and cos.shape[0] == 1
            and cos.shape[-1] == q.shape[-1]
            and _fp32_cpu(q, k, cos, sin)
            and not torch.is_autocast_enabled("cpu")
        ):
            c, s = cos.squeeze(0), sin.squeeze(0)
            return tuple(
                kernels.rope(x.squeeze(0).transpose(0, 1), c, s).transpose(0, 1).unsqueeze(0)
                for x in (q, k)
            )
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.__doc__ = (original.__doc__ or "") + "\n(postrl: fused on fp32 CPU.)"
    apply_rotary_pos_emb._postrl_original = original
    return apply_rotary_pos_emb


def _patch_rope(cls: type) -> bool:
    mod = sys.modules.get(cls.__module__)
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        return False
    if not hasattr(fn, "_postrl_original"):
        mod.apply_rotary_pos_emb = _fused_rope(fn)
    return True


def _fused_class(cls: type, forward, **attrs) -> type:
    """``cls`` with ``forward`` and class attributes ``attrs`` (one subclass per class, named
    after it)."""
    if cls not in _subclasses:
        _subclasses[cls] = type(
            cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__, **attrs}
        )
    return _subclasses[cls]


def install(model: nn.Module, mode: str = "auto") -> dict[str, int]:
    """Fuse ``model``'s recognised modules (in place); returns how many of each kind.

    Args:
        model: a transformers causal LM (or its decoder), possibly wrapped by peft.
        mode: ``auto`` (fuse when the kernels build, else log why and keep torch's ops),
            ``fused`` (raise ``RuntimeError`` with the reason when they cannot) or ``torch``
            (do nothing).
    """
    if mode not in ("auto", "fused", "torch"):
        raise ValueError(f"kernels={mode!r} is not one of 'auto', 'fused', 'torch'")
    counts = {"rms_norm": 0, "swiglu": 0, "attention": 0, "rope": 0}
    if mode == "torch":
        return counts
    if next(model.parameters()).device.type != "cpu":
        if mode == "fused":
            raise RuntimeError("model.kernels='fused': the fused training kernels are CPU-only")
        return counts
    if kernels.load() is None:
        if mode == "fused":
            raise RuntimeError(
                f"model.kernels='fused' but the fused training kernels cannot run: "
                f"{kernels.build_error()}; use model.kernels=auto or torch"
            )
        return counts
    for m in model.modules():
        base = type(m).__mro__[1] if type(m) in _subclasses.values() else type(m)
        if base.__name__ in _NORMS and hasattr(m, "variance_epsilon"):
            m.__class__ = _fused_class(base, _norm_forward)
            counts["rms_norm"] += 1
        elif (
            base.__name__ in _MLPS
            and type(getattr(m, "act_fn", None)).__name__ in _SILUS
            and all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))
        ):
            m.__class__ = _fused_class(base, _mlp_forward)
            counts["swiglu"] += 1
        elif base.__name__ in _ATTENTIONS:
            m.__class__ = _fused_class(base, _attention_forward, **{FUSED_ATTENTION: True})
            counts["attention"] += 1
            counts["rope"] += _patch_rope(type(m))
    logger.info("fused training kernels: %s", counts)
    return counts
