"""Load Hugging Face models for training: policy (causal LM, optional LoRA) and critic.

* ``load_policy(spec, device)`` returns a :class:`PolicyModel`: the HF causal LM (wrapped
  by ``peft`` when ``model.lora_rank > 0``), with gradient checkpointing if configured and the
  attention implementation switched to postrl's varlen attention (see
  :mod:`postrl.engine.varlen`), which the padding-free forward needs.
* ``load_critic(spec, device)`` returns a :class:`CriticModel`: the same backbone
  (``AutoModel``, i.e. the decoder without the LM head) plus our own scalar value head
  ``nn.Linear(hidden, 1)`` initialised to zero (so the first value predictions are 0, a neutral
  baseline). We use our own head instead of ``AutoModelForTokenClassification`` because the latter
  does not exist for every architecture and adds dropout; the head is saved next to the backbone
  as ``value_head.safetensors``.

``spec`` is a :class:`ModelSpec` (the ``model.*`` keys of the config, filled by the role workers).
dtype ``auto`` means fp32 on CPU and bf16 on GPU (``ModelSpec.dtype``).

With LoRA the reference policy is the same module with adapters disabled
(:meth:`PolicyModel.reference`), so no second copy of the weights exists.

Engines run the padding-free forward through one module call — :meth:`PolicyModel.logprobs`
(the :class:`PolicyLogProbs` root) and ``CriticModel.__call__`` — so that with dp > 1 those
modules can be the FSDP2 root (:meth:`PolicyModel.shard` / :meth:`CriticModel.shard`, see
:mod:`postrl.engine.fsdp`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from postrl.engine import fused
from postrl.engine.logprob import critic_values, pack, policy_logprobs
from postrl.engine.specs import ModelSpec
from postrl.engine.varlen import ATTN_NAME, register_varlen_attention, varlen_calls

logger = logging.getLogger(__name__)

__all__ = [
    "ModelSpec",
    "PolicyModel",
    "PolicyLogProbs",
    "CriticModel",
    "resolve_dtype",
    "resolve_dtypes",
    "load_policy",
    "load_critic",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """Map a dtype name to a torch dtype (``auto``: fp32 on CPU, bf16 on GPU)."""
    if dtype == "auto":
        return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(
            f"model.dtype={dtype!r} is not supported; use one of ['auto', *{sorted(_DTYPES)}]"
        )
    return _DTYPES[dtype]


def resolve_dtypes(
    model_cfg: ModelSpec, device: torch.device | str, *, trainable: bool = True
) -> tuple[torch.dtype, torch.dtype]:
    """``(storage, compute)`` dtypes of a model (``ModelSpec.dtype`` / ``compute_dtype``).

    compute ``auto``: fp32 on CPU, bf16 on GPU. storage ``auto``: fp32 for a trained model (fp32
    master weights, gradients and AdamW state, as verl's FSDP workers keep them), the compute
    dtype for a frozen one (the reference needs no master copy).

    Raises:
        ValueError: for a dtype name the engine cannot run (config validation also rejects the
            combinations that run but make no sense, e.g. compute wider than storage).
    """
    compute_name = getattr(model_cfg, "compute_dtype", "auto")
    if model_cfg.dtype not in ("auto", *_DTYPES):
        raise ValueError(f"model.dtype={model_cfg.dtype!r} is not one of {['auto', *_DTYPES]}")
    if compute_name not in ("auto", "float32", "bfloat16"):
        why = " (float16 training needs loss scaling, which postrl does not do; use bfloat16)"
        raise ValueError(
            f"model.compute_dtype={compute_name!r} is not one of ['auto', 'float32', 'bfloat16']"
            + (why if compute_name == "float16" else "")
        )
    compute = resolve_dtype(compute_name, device)
    if model_cfg.dtype != "auto":
        store = _DTYPES[model_cfg.dtype]
        if compute_name == "auto" and store.itemsize < 4:
            compute = store  # explicit 16-bit storage, auto compute: compute in the storage dtype
        return store, compute
    return (torch.float32 if trainable else compute), compute


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``device``'s type, or nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_path(path: str) -> Path:
    p = Path(path)
    if not path or not (p / "config.json").exists():
        raise FileNotFoundError(
            f"model.path={path!r} is not a Hugging Face model directory (no config.json); "
            "create a tiny one with `postrl make-model OUT` or point model.path at a local HF dir"
        )
    return p


def _causal_lm(module: nn.Module, is_lora: bool) -> nn.Module:
    return module.get_base_model() if is_lora else module


def _lm_head(causal_lm: nn.Module) -> nn.Linear:
    head = causal_lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"lm head of {type(causal_lm).__name__} is {type(head).__name__}, need nn.Linear"
        )
    return head


def _zero_pass(root: nn.Module) -> None:
    """One forward (+ backward under grad mode) of ``root`` on a 2-token row, contributing 0."""
    dev = next(root.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=dev)
    out = root(ids, torch.ones_like(ids), 1)
    out = out[0] if isinstance(out, tuple) else out
    if torch.is_grad_enabled() and out.requires_grad:
        (out.sum() * 0.0).backward()


class _DataParallelRoot:
    """FSDP2 sharding and micro-batch alignment shared by :class:`PolicyModel` and
    :class:`CriticModel`; each names its FSDP2 root module in ``_fsdp_root``."""

    dp_group: dist.ProcessGroup | None
    dummy_passes: int

    def _fsdp_root(self) -> nn.Module:
        raise NotImplementedError

    def shard(self, group: dist.ProcessGroup, device: torch.device | str) -> None:
        """FSDP2-shard the decoder layers and the root module over ``group`` (build optimizers
        afterwards).

        With mixed precision the FSDP2 units gather parameters in the compute dtype and reduce
        gradients in the storage dtype, in place of the unsharded path's autocast."""
        from postrl.engine.fsdp import shard_model

        root = self._fsdp_root()
        shard_model(root, group, device, compute_dtype=root.autocast_dtype)
        root.autocast_dtype = None  # FSDP2 casts the gathered parameters instead
        self.dp_group = group

    def align_micro_batches(
        self, micro: list[list[int]], seqlens: torch.Tensor, unit_ids: torch.Tensor | None = None
    ) -> list[list[int]]:
        """Same micro-batch count on every rank when sharded
        (:func:`postrl.engine.fsdp.align_micro_batches`);
        unchanged otherwise."""
        if self.dp_group is None:
            return micro
        from postrl.engine.fsdp import align_micro_batches

        def dummy() -> None:
            self.dummy_passes += 1
            _zero_pass(self._fsdp_root())

        return align_micro_batches(micro, seqlens, self.dp_group, dummy, unit_ids)


class PolicyLogProbs(nn.Module):
    """The whole padding-free log-prob computation as one module call (the FSDP2 root).

    ``forward`` runs the decoder and the chunked LM head
    (:func:`postrl.engine.logprob.policy_logprobs`), so every use of the embeddings, the final
    norm and the head happens inside it (see :mod:`postrl.engine.fsdp` for why that matters).

    Args:
        module: the trainable module (``PolicyModel.module``), registered as a child.
        is_lora: whether ``module`` is a ``PeftModel``.
    """

    def __init__(
        self,
        module: nn.Module,
        is_lora: bool,
        packed: bool = True,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.is_lora = is_lora
        self.packed = packed
        self.autocast_dtype = autocast_dtype
        """Mixed precision without FSDP2: the forward runs under ``torch.autocast`` to this
        dtype."""

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        share_prefix: bool = False,
        calculate_sum_pi_squared: bool = False,
        topk: int = 0,
        logprobs_at: torch.Tensor | None = None,
    ):
        """``(log_probs (B, R), entropy (B, R) or None[, extras])``; see
        :func:`postrl.engine.logprob.policy_logprobs` (``sum_pi_squared``, ``topk``,
        ``logprobs_at``)."""
        lm = _causal_lm(self.module, self.is_lora)
        with _autocast(input_ids.device, self.autocast_dtype):
            return policy_logprobs(
                lm.base_model,
                _lm_head(lm),
                input_ids,
                attention_mask,
                response_length,
                temperature=temperature,
                calculate_entropy=calculate_entropy,
                share_prefix=share_prefix,
                packed=self.packed,
                calculate_sum_pi_squared=calculate_sum_pi_squared,
                topk=topk,
                logprobs_at=logprobs_at,
            )


@dataclass
class PolicyModel(_DataParallelRoot):
    """A causal LM ready for padding-free training.

    Attributes:
        module: the trainable module (a ``PeftModel`` with LoRA, else the HF causal LM).
        is_lora: whether LoRA adapters are attached.
        dp_group: the process group the parameters are FSDP2-sharded over (None: not sharded).
        dummy_passes: zero-contribution passes run so far to keep sharded ranks in step.
    """

    module: nn.Module
    is_lora: bool
    dp_group: dist.ProcessGroup | None = None
    dummy_passes: int = 0
    """Zero-contribution passes run to keep FSDP2 ranks in step (:meth:`align_micro_batches`)."""
    packed: bool = True
    """Padding-free varlen forward (False: the model cannot use it; padded fallback)."""
    compute_dtype: torch.dtype | None = None
    """Mixed precision: the dtype the math runs in when narrower than the parameters' (None:
    theirs)."""
    _runner: PolicyLogProbs | None = field(default=None, repr=False)

    @property
    def causal_lm(self) -> nn.Module:
        """The HF ``*ForCausalLM`` (LoRA layers injected in place when ``is_lora``)."""
        return _causal_lm(self.module, self.is_lora)

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack returning hidden states (``causal_lm.model`` for most archs)."""
        return self.causal_lm.base_model

    @property
    def lm_head(self) -> nn.Module:
        """The output projection (a ``nn.Linear`` over the vocabulary)."""
        return _lm_head(self.causal_lm)

    @property
    def runner(self) -> PolicyLogProbs:
        """The :class:`PolicyLogProbs` module over :attr:`module` (created on first use)."""
        if self._runner is None:
            self._runner = PolicyLogProbs(
                self.module, self.is_lora, self.packed, self.compute_dtype
            )
        return self._runner

    def logprobs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        *,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        share_prefix: bool = False,
        calculate_sum_pi_squared: bool = False,
        topk: int = 0,
        logprobs_at: torch.Tensor | None = None,
    ):
        """Padding-free ``(log_probs (B, R), entropy (B, R) or None)`` of one micro-batch, then
        the extras asked for (:func:`postrl.engine.logprob.policy_logprobs`): ``sum_pi_squared``
        (B, R); ``topk`` log-probs and ids (B, R, K); log-probs at ``logprobs_at`` (B, R, K).

        Always call the model through this (not ``decoder`` + ``lm_head``) in engines that may run
        sharded: it is the FSDP2 root's forward.
        """
        return self.runner(
            input_ids,
            attention_mask,
            response_length,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            share_prefix=share_prefix,
            calculate_sum_pi_squared=calculate_sum_pi_squared,
            topk=topk,
            logprobs_at=logprobs_at,
        )

    def _fsdp_root(self) -> nn.Module:
        return self.runner

    def reference(self) -> contextlib.AbstractContextManager:
        """Context in which the module computes the reference policy (LoRA: adapters disabled)."""
        if not self.is_lora:
            raise RuntimeError(
                "reference() needs LoRA (model.lora_rank > 0); otherwise use a RefWorker copy"
            )
        return self.module.disable_adapter()

    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters with ``requires_grad`` (LoRA: the adapters only)."""
        return (p for p in self.module.parameters() if p.requires_grad)


class CriticModel(_DataParallelRoot, nn.Module):
    """Decoder backbone + scalar value head: ``V(s_t) = w · h_t + b`` per token.

    Args:
        backbone: an HF base model (``AutoModel``) returning ``last_hidden_state``.
        hidden_size: width of the hidden states.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

        self.dp_group: dist.ProcessGroup | None = None
        self.dummy_passes = 0
        self.packed = True  # False: padded fallback (see load_critic)
        self.autocast_dtype: torch.dtype | None = (
            None  # mixed precision without FSDP2 (see load_critic)
        )

    @property
    def decoder(self) -> nn.Module:
        """The backbone (same role as :attr:`PolicyModel.decoder`)."""
        return self.backbone

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_length: int,
        *,
        share_prefix: bool = False,
    ) -> torch.Tensor:
        """Values (B, R) fp32 of the response tokens
        (:func:`postrl.engine.logprob.critic_values`)."""
        with _autocast(input_ids.device, self.autocast_dtype):
            return critic_values(
                self.backbone,
                self.value_head,
                input_ids,
                attention_mask,
                response_length,
                share_prefix=share_prefix,
                packed=self.packed,
            )

    def _fsdp_root(self) -> nn.Module:
        return self


def _common_kwargs(model_cfg: ModelSpec, dtype: torch.dtype) -> dict:
    return dict(
        dtype=dtype,
        trust_remote_code=model_cfg.trust_remote_code,
        attn_implementation=ATTN_NAME,
    )


def _from_pretrained(auto_cls, path: Path, kw: dict) -> nn.Module:
    """``auto_cls.from_pretrained`` with postrl's varlen attention; a model class that refuses a
    custom attention implementation is loaded with its default one instead (padded fallback)."""
    register_varlen_attention()
    try:
        return auto_cls.from_pretrained(str(path), **kw)
    except ValueError as e:
        if ATTN_NAME not in str(e) and "attn_implementation" not in str(e):
            raise
        logger.warning(
            "%s: %s; loading with the default attention (padded training forward)", path, e
        )
        return auto_cls.from_pretrained(
            str(path), **{k: v for k, v in kw.items() if k != "attn_implementation"}
        )


def _use_varlen(model: nn.Module, decoder: nn.Module) -> bool:
    """Probe whether ``decoder``'s attention layers really run postrl's varlen attention.

    A model whose attention does not dispatch through transformers' ``AttentionInterface``
    (older remote code) would silently ignore the packed layout. One no-grad forward over a
    4-token packed row counts the varlen calls; without any, the model is switched to ``sdpa``
    and trains with the padded forward (``PolicyModel.packed = False``), with a warning.
    """
    if getattr(model.config, "_attn_implementation", None) != ATTN_NAME:
        return False
    dev = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 1, 3]], device=dev) % max(
        int(getattr(model.config, "vocab_size", 4) or 4), 1
    )
    pk = pack(ids, torch.ones_like(ids), 2)
    before = varlen_calls()
    with torch.no_grad():
        try:
            decoder(
                input_ids=pk.input_ids,
                position_ids=pk.position_ids,
                postrl_layout=pk.layout,
                use_cache=False,
            )
            ok = varlen_calls() > before
        except Exception as e:  # a forward that rejects the layout kwarg cannot pack either
            logger.warning("varlen probe failed for %s: %r", type(model).__name__, e)
            ok = False
    if not ok:
        logger.warning(
            "%s does not run postrl's varlen attention; training uses the padded forward "
            "(slower: no padding removal or prompt sharing)",
            type(model).__name__,
        )
        model.set_attn_implementation("sdpa")
    return ok


def load_policy(
    model_cfg: ModelSpec, device: torch.device | str = "cpu", *, trainable: bool = True
) -> PolicyModel:
    """Load ``model_cfg.path`` as a :class:`PolicyModel` on ``device``.

    Args:
        model_cfg: a :class:`ModelSpec`.
        device: where to put the weights.
        trainable: False freezes everything (reference model) and skips LoRA/checkpointing.
    """
    from transformers import AutoModelForCausalLM

    path = _check_path(model_cfg.path)
    store, compute = resolve_dtypes(model_cfg, device, trainable=trainable)
    mixed = compute if compute != store else None
    model = _from_pretrained(AutoModelForCausalLM, path, _common_kwargs(model_cfg, store)).to(
        device
    )
    model.config.use_cache = False
    packed = _use_varlen(model, model.base_model)
    fused.install(model, model_cfg.kernels)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
        return PolicyModel(model, is_lora=False, packed=packed, compute_dtype=mixed)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    is_lora = model_cfg.lora_rank > 0
    if is_lora:
        from peft import LoraConfig, get_peft_model

        targets = model_cfg.lora_target_modules
        lcfg = LoraConfig(
            r=model_cfg.lora_rank,
            lora_alpha=model_cfg.lora_alpha,
            target_modules=targets
            if targets == "all-linear"
            else [t.strip() for t in targets.split(",")],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg)
        if model_cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    model.train()
    # No dropout in RL recomputation: log-probs must be deterministic functions of the weights.
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return PolicyModel(model, is_lora=is_lora, packed=packed, compute_dtype=mixed)


def _checkpoint_tensors(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in names if k in h.keys()})
    return out


def load_critic(model_cfg: ModelSpec, device: torch.device | str = "cpu") -> CriticModel:
    """Load ``model_cfg.path`` as a :class:`CriticModel` (backbone + zero-initialised value head).

    If the directory holds ``value_head.safetensors`` (a critic exported by postrl), the head is
    restored from it; if it is a reward model (one-label ``*ForSequenceClassification`` with a
    ``score`` head), the value head starts as its score head.
    """
    from safetensors.torch import load_file
    from transformers import AutoModel

    path = _check_path(model_cfg.path)
    store, compute = resolve_dtypes(model_cfg, device)
    kw = _common_kwargs(model_cfg, store)
    backbone = _from_pretrained(AutoModel, path, kw).to(device)
    backbone.config.use_cache = False
    packed = _use_varlen(backbone, backbone)
    fused.install(backbone, model_cfg.kernels)
    if model_cfg.gradient_checkpointing:
        backbone.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    critic = CriticModel(backbone, backbone.config.hidden_size).to(device=device, dtype=kw["dtype"])
    critic.packed = packed
    critic.autocast_dtype = compute if compute != store else None
    head = path / "value_head.safetensors"
    if head.exists():
        critic.value_head.load_state_dict(load_file(str(head)))
    elif getattr(backbone.config, "num_labels", None) == 1 and "score.weight" in (
        score := _checkpoint_tensors(path, ("score.weight", "score.bias"))
    ):  # a reward model: its head is the value head
        with torch.no_grad():
            critic.value_head.weight.copy_(score["score.weight"])
            if "score.bias" in score:
                critic.value_head.bias.copy_(score["score.bias"])
        logger.info("critic: value head initialised from the reward model's score head (%s)", path)
    critic.train()
    return critic
