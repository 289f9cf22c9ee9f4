"""Compact decoder for the Qwen2 / Llama / Qwen3 families, loading HF safetensors directly.

The math follows the HF reference implementations exactly (so greedy decoding matches
``transformers`` token for token):

- RMSNorm: ``w * (x / sqrt(mean(x²) + eps))`` computed in fp32, cast back before the weight.
- RoPE (rotate-half convention): ``q' = q·cos + rotate_half(q)·sin`` with
  ``inv_freq_i = θ^(-2i/D)``; scaling types ``default``, ``linear`` (positions / factor),
  ``llama3`` (frequency-band-wise rescaling, Llama 3.1) and ``yarn`` (arXiv 2309.00071: ramp
  between interpolation and extrapolation, cos/sin scaled by ``0.1·ln(factor)+1``).
- GQA: query head ``h`` reads key/value head ``h // (H / H_kv)``.
- Qwen3 q/k-norm: RMSNorm over ``head_dim`` of q and k before RoPE.
- SwiGLU MLP: ``down(silu(gate(x)) · up(x))``; attention biases where the checkpoint has them.

For speed, q/k/v projections are fused into one matrix and gate/up into another; HF parameter
names map to *views* of the fused tensors, so ``update_weights`` copies in place.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "DecoderConfig",
    "DecoderWeights",
    "load_config",
    "load_weights",
    "rope_tables",
    "rms_norm",
    "apply_rope",
    "apply_rope_fast",
]

SUPPORTED = ("qwen2", "llama", "qwen3", "mistral")


@dataclass(frozen=True)
class DecoderConfig:
    """The subset of an HF ``config.json`` the decoder needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]


def _as_tuple(x: object) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(v) for v in x)  # type: ignore[union-attr]


def load_config(model_dir: str | Path) -> DecoderConfig:
    """Parse ``config.json`` (and ``generation_config.json`` for EOS ids); raise on unsupported
    architectures with the list of supported ones and the fix (use the ``hf`` backend)."""
    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    mt = cfg.get("model_type")
    if mt not in SUPPORTED:
        raise ValueError(
            f"native rollout backend does not support model_type={mt!r} (supported: {SUPPORTED}); "
            f"use backend='hf' for other architectures"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"hidden_act={act!r} unsupported by the native backend (needs 'silu'); use backend='hf'"
        )
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ValueError(
            "sliding-window attention is not supported by the native backend; use backend='hf'"
        )
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling.update({k: v for k, v in rope.items() if k != "rope_theta"})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = d / "generation_config.json"
    if gen_path.exists():
        eos = tuple(
            dict.fromkeys(eos + _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id")))
        )
    heads = int(cfg["num_attention_heads"])
    return DecoderConfig(
        model_type=mt,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        eos_token_ids=eos,
    )


# ---------------------------------------------------------------------------------------- RoPE
def _inv_freq(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq (D/2,), attention_scaling)`` for the config's RoPE type (fp32)."""
    D = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    sc = cfg.rope_scaling
    kind = sc.get("rope_type", "default")
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / float(sc["factor"]), 1.0
    if kind == "llama3":
        factor, lo, hi = (
            float(sc["factor"]),
            float(sc["low_freq_factor"]),
            float(sc["high_freq_factor"]),
        )
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / base
        inv = torch.where(wavelen > old / lo, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv / factor + smooth * inv
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, inv), 1.0
    if kind == "yarn":
        factor = float(sc["factor"])
        old = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        beta_fast, beta_slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)
        mscale = sc.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

        def dim_of(rot: float) -> float:
            return (D * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(dim_of(beta_fast)), 0)
        high = min(math.ceil(dim_of(beta_slow)), D - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(D // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrap = 1 - ramp
        inv = (base / factor) * (1 - extrap) + base * extrap
        return inv, float(mscale)
    raise ValueError(
        f"rope_type={kind!r} is not supported by the native backend (supported: default, linear, "
        f"llama3, yarn); use backend='hf'"
    )


def rope_tables(
    cfg: DecoderConfig, max_len: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` tables of shape (max_len, D) for positions ``0 .. max_len-1``."""
    inv, scale = _inv_freq(cfg)
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv[None, :]  # (T, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, D)
    return (emb.cos() * scale).to(device=device, dtype=dtype), (emb.sin() * scale).to(
        device=device, dtype=dtype
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x``: (..., H, D); ``cos``/``sin`` broadcastable (..., 1, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def apply_rope_fast(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Same as ``apply_rope`` in 3 ops: ``rotate_half(x)·sin = roll(x, D/2)·[-sin₁, sin₂]``.

    ``sin_signed`` = ``sin`` with its first half negated (sign flips are exact in IEEE).
    """
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin_signed)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in fp32, cast back to the input dtype, then scale by ``w``.

    fp32 inputs use the fused ``F.rms_norm`` (same formula, one kernel).
    """
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


# ---------------------------------------------------------------------------------------- weights
@dataclass
class LayerWeights:
    """One decoder layer's (fused) parameters."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    w_qkv: torch.Tensor  # ((H + 2·H_kv)·D, hidden)
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    w_gu: torch.Tensor  # (2·I, hidden)
    w_down: torch.Tensor


@dataclass
class DecoderWeights:
    """All parameters plus ``views``: HF name → tensor view to copy updates into."""

    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    views: dict[str, torch.Tensor]


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors in {model_dir}; save the model with safe_serialization=True"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def load_weights(
    model_dir: str | Path, cfg: DecoderConfig, dtype: torch.dtype, device: torch.device
) -> DecoderWeights:
    """Load HF safetensors into fused tensors (``dtype``, ``device``)."""
    raw = _read_safetensors(Path(model_dir))
    raw = {k.removeprefix("model.") if k.startswith("model.") else k: v for k, v in raw.items()}

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise KeyError(f"checkpoint lacks {name!r}; is this a {cfg.model_type} model?")
        return raw[name].to(device=device, dtype=dtype)

    views: dict[str, torch.Tensor] = {}
    H, Hkv, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    sizes = [H * D, Hkv * D, Hkv * D]
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        w_qkv = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"], 0).contiguous()
        for n, v in zip("qkv", w_qkv.split(sizes, 0), strict=True):
            views[f"model.{a}{n}_proj.weight"] = v
        b_qkv = None
        if a + "q_proj.bias" in raw:
            b_qkv = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"], 0).contiguous()
            for n, v in zip("qkv", b_qkv.split(sizes, 0), strict=True):
                views[f"model.{a}{n}_proj.bias"] = v
        w_gu = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0
        ).contiguous()
        views[f"model.{p}mlp.gate_proj.weight"], views[f"model.{p}mlp.up_proj.weight"] = w_gu.split(
            [inter, inter], 0
        )
        lw = LayerWeights(
            ln1=take(p + "input_layernorm.weight"),
            ln2=take(p + "post_attention_layernorm.weight"),
            w_qkv=w_qkv,
            b_qkv=b_qkv,
            w_o=take(a + "o_proj.weight"),
            b_o=take(a + "o_proj.bias") if a + "o_proj.bias" in raw else None,
            q_norm=take(a + "q_norm.weight") if a + "q_norm.weight" in raw else None,
            k_norm=take(a + "k_norm.weight") if a + "k_norm.weight" in raw else None,
            w_gu=w_gu,
            w_down=take(p + "mlp.down_proj.weight"),
        )
        for attr, name in [
            ("ln1", p + "input_layernorm.weight"),
            ("ln2", p + "post_attention_layernorm.weight"),
            ("w_o", a + "o_proj.weight"),
            ("b_o", a + "o_proj.bias"),
            ("q_norm", a + "q_norm.weight"),
            ("k_norm", a + "k_norm.weight"),
            ("w_down", p + "mlp.down_proj.weight"),
        ]:
            t = getattr(lw, attr)
            if t is not None:
                views["model." + name] = t
        layers.append(lw)
    embed = take("embed_tokens.weight")
    norm = take("norm.weight")
    views["model.embed_tokens.weight"] = embed
    views["model.norm.weight"] = norm
    if cfg.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    views["lm_head.weight"] = lm_head
    return DecoderWeights(embed=embed, norm=norm, lm_head=lm_head, layers=layers, views=views)


def mlp(x: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
    """SwiGLU: ``down(silu(gate x) · up x)`` with fused gate/up. ``x``: (..., hidden)."""
    g, u = F.linear(x, lw.w_gu).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, lw.w_down)
