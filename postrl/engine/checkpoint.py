"""Engine checkpoints (model + optimizer + scheduler + RNG), per-tensor weight streaming, HF export.

Layout of a checkpoint directory (written to ``<dir>.tmp-<pid>`` then renamed, so a crash never
leaves a half-written checkpoint under the final name)::

    model.safetensors      every tensor of the trained module (LoRA: base + adapters), full
                           (unsharded), one name per tied tensor
    optim.safetensors      optimizer state tensors, full, keyed ``<param index>.<name>``
    rng.safetensors        torch CPU (and CUDA) generator states
    state.json             optimizer param groups, scheduler state, python/numpy RNG, counters,
                           and the ``ModelConfig`` needed to rebuild the module (export)

Nothing is unpickled on load: tensors come from safetensors, the rest from JSON.

FSDP2-sharded modules (``strategy=fsdp2``, :mod:`postrl.engine.fsdp`) are saved in the same
format: every rank calls :func:`save_engine_checkpoint`, each parameter and optimizer moment is
all-gathered one tensor at a time (``DTensor.full_tensor()``), and only rank 0 (``write=True``)
keeps the CPU copies and writes. Loading reads the full files on every rank and cuts each rank's
shard locally (no communication). One format for every strategy and dp size therefore: a
checkpoint written with dp=2/fsdp2 resumes with dp=1 or ddp, and ``postrl export`` reads it as
is. The cost is that rank 0 holds one full copy of model + optimizer state in CPU memory while
writing.

**Sharded format** (``trainer.checkpoint_format=sharded``, FSDP2 modules only): every rank
writes its own shards, with no gathers and no full copy anywhere::

    model-rank00000.safetensors   this rank's dim-0 shard of every sharded tensor (+ the small
    optim-rank00000.safetensors   replicated ones: buffers, AdamW ``step``), one pair per rank
    rng.safetensors, state.json   as above; state.json adds ``format``, ``world_size`` and the
                                  full shape of every sharded tensor

The ranks write into one shared temporary directory that rank 0 renames when all are done (so
multi-node runs need a shared filesystem for ``run_dir``, as verl's do). Resuming with the same
dp size reads only the own rank's files; any other dp size, ``ddp`` or dp=1 concatenates the
shards (FSDP2 shards dim 0 in ``torch.chunk`` order) and cuts its own shard from the result, and
``postrl export`` merges them the same way.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from postrl.engine.fsdp import full_tensor, is_sharded, shard_like

__all__ = [
    "iter_hf_params",
    "save_engine_checkpoint",
    "load_engine_checkpoint",
    "export_hf",
    "save_hf",
    "CHECKPOINT_FORMATS",
]

CHECKPOINT_FORMATS = ("full", "sharded")
"""Values of ``trainer.checkpoint_format``."""


def _lora_delta(mod: nn.Module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """``ΔW = (α/r)·B·A`` of one adapter of a peft ``Linear`` LoRA layer, from full tensors."""
    if getattr(mod, "use_dora", {}).get(adapter, False):
        raise NotImplementedError("DoRA adapters cannot be merged by postrl's weight stream")
    a = full_tensor(mod.lora_A[adapter].weight.detach())
    b = full_tensor(mod.lora_B[adapter].weight.detach())
    delta = b @ a
    if getattr(mod, "fan_in_fan_out", False):
        delta = delta.t()
    return (delta * mod.scaling[adapter]).to(weight.dtype)


def iter_hf_params(policy) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` of a :class:`PolicyModel`, one tensor at a time.

    Names are those of the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``). Tied
    weights are yielded once (under the first name, as ``named_parameters`` dedups them). With
    LoRA each adapted linear yields its merged weight ``W + (α/r)·B·A`` under the base name;
    adapter tensors themselves are not yielded. Tensors are detached views (merged ones fresh).

    FSDP2-sharded parameters are all-gathered one at a time (``DTensor.full_tensor()``), so at
    most one full parameter (plus a LoRA pair) is materialised per step. That is a collective:
    every rank of the dp group must drain the generator in lockstep (the worker's weight
    methods run on all ranks; ranks other than 0 discard the tensors).
    """
    lm = policy.causal_lm
    lora_mods: dict[str, nn.Module] = {}
    if policy.is_lora:
        from peft.tuners.lora import LoraLayer

        lora_mods = {n: m for n, m in lm.named_modules() if isinstance(m, LoraLayer)}
    for name, p in lm.named_parameters():
        if not lora_mods:
            yield name, full_tensor(p.detach())
            continue
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            mod_name, _, leaf = name.rpartition(".base_layer.")
            mod = lora_mods[mod_name]
            t = full_tensor(p.detach())
            if leaf == "weight":
                with torch.no_grad():
                    for a in mod.active_adapters:
                        if a in mod.lora_A:
                            t = t + _lora_delta(mod, a, t)
            yield f"{mod_name}.{leaf}", t
        else:
            yield name, full_tensor(p.detach())
    persistent = set(lm.state_dict(keep_vars=True))
    for name, b in lm.named_buffers():
        if name in persistent:
            yield name, b.detach()


def _optim_items(
    opt: torch.optim.Optimizer,
) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any]]:
    sd = opt.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    tensors = []
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors.append((f"{pid}.{k}", v))
            else:
                scalars.setdefault(str(pid), {})[k] = v
    return iter(tensors), {"param_groups": sd["param_groups"], "scalars": scalars}


def _optim_split(
    opt: torch.optim.Optimizer, keep: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Full optimizer state tensors keyed ``<pid>.<name>`` (gathered from shards) + JSON meta."""
    items, meta = _optim_items(opt)
    tensors: dict[str, torch.Tensor] = {}
    for key, v in items:
        full = full_tensor(v.detach())  # a collective for a sharded moment: every rank, same order
        if keep:
            tensors[key] = full.contiguous().cpu()
    return tensors, meta


def _optim_join(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], opt: torch.optim.Optimizer
) -> dict[str, Any]:
    """Inverse of :func:`_optim_split`; moments of sharded parameters become this rank's shard
    (values that already are ``DTensor`` s are used as they are)."""
    params = [p for g in opt.param_groups for p in g["params"]]  # index = pid of state_dict()
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        pid, _, k = key.partition(".")
        p = params[int(pid)]
        if not isinstance(v, DTensor) and v.shape == p.shape:
            v = shard_like(v, p)
        state.setdefault(int(pid), {})[k] = v
    for pid, d in meta["scalars"].items():
        state.setdefault(int(pid), {}).update(d)
    return {"state": state, "param_groups": meta["param_groups"]}


def _aliases(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """``state_dict(keep_vars=True)`` and its names grouped by tensor identity (tied weights)."""
    sd = module.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for k, v in sd.items():
        groups.setdefault(id(v), []).append(k)
    return sd, list(groups.values())


def _full_model_state(module: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU tensors of ``module``'s state dict, one (sorted-first) name per tied tensor as
    ``safetensors.save_model`` writes them; sharded parameters gathered one at a time."""
    sd, groups = _aliases(module)
    out: dict[str, torch.Tensor] = {}
    for names in groups:
        full = full_tensor(sd[names[0]].detach())
        if keep:
            out[sorted(names)[0]] = full.contiguous().cpu()
    return out


def _load_model_state(module: nn.Module, on_disk: dict[str, torch.Tensor], path: Path) -> None:
    """Load full tensors (or this rank's ``DTensor`` s) into ``module``; sharded parameters get
    this rank's shard. ``path`` names the source in errors."""
    sd, groups = _aliases(module)
    new: dict[str, torch.Tensor] = {}
    missing = []
    for names in groups:
        src = next((on_disk[n] for n in names if n in on_disk), None)
        if src is None:
            missing.extend(names)
            continue
        value = src if isinstance(src, DTensor) else shard_like(src, sd[names[0]])
        new.update(dict.fromkeys(names, value))
    unexpected = sorted(set(on_disk) - set(sd))
    if missing or unexpected:
        raise KeyError(
            f"{path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
            "was it written for another model.path or LoRA setting?"
        )
    module.load_state_dict(new, strict=True)


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    npst = np.random.get_state()
    return tensors, {"python": random.getstate(), "numpy": [npst[0], npst[1].tolist(), *npst[2:]]}


def _set_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    v, state, gauss = meta["python"]
    random.setstate((v, tuple(state), gauss))
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))


def _sched_state(sched) -> dict[str, Any]:
    return {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}


def _sharded_group(module: nn.Module):
    """(process group, rank, world size) of the dp mesh of ``module``'s sharded parameters."""
    p = next(p for p in module.parameters() if isinstance(p, DTensor))
    mesh = p.device_mesh
    return mesh.get_group(), mesh.get_local_rank(), mesh.size()


def _local_tensors(
    items: Iterator[tuple[str, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """This rank's part of each tensor (``to_local()`` of a ``DTensor``, else the tensor) and
    the full shapes of the sharded ones."""
    local: dict[str, torch.Tensor] = {}
    shapes: dict[str, list[int]] = {}
    for name, t in items:
        if isinstance(t, DTensor):
            shapes[name] = list(t.shape)
            t = t.to_local()
        local[name] = t.detach().contiguous().cpu()
    return local, shapes


def _swap_into(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _save_sharded(final: Path, module: nn.Module, optimizer, scheduler, model_cfg, extra) -> Path:
    group, rank, world = _sharded_group(module)
    tmp = final.parent / f".{final.name}.tmp-sharded"
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier(group)
    sd, groups = _aliases(module)
    mlocal, mshapes = _local_tensors((sorted(names)[0], sd[names[0]]) for names in groups)
    save_file(mlocal, str(tmp / f"model-rank{rank:05d}.safetensors"))
    oitems, ometa = _optim_items(optimizer)
    olocal, oshapes = _local_tensors(oitems)
    save_file(olocal, str(tmp / f"optim-rank{rank:05d}.safetensors"))
    del mlocal, olocal
    dist.barrier(group)  # every rank's files are complete
    if rank == 0:
        rtensors, rmeta = _rng_state()
        save_file(rtensors, str(tmp / "rng.safetensors"))
        state = {
            "format": "sharded",
            "world_size": world,
            "model_shapes": mshapes,
            "optim_shapes": oshapes,
            "optimizer": ometa,
            "scheduler": _sched_state(scheduler),
            "rng": rmeta,
            "extra": dict(extra or {}),
            "model_cfg": dataclasses.asdict(model_cfg) if model_cfg is not None else None,
        }
        (tmp / "state.json").write_text(json.dumps(state))
        _swap_into(tmp, final)
    dist.barrier(group)  # nobody reads the checkpoint before it has its final name
    return final


def _rank_file(ck: Path, kind: str, rank: int) -> Path:
    return ck / f"{kind}-rank{rank:05d}.safetensors"


def _merged(
    ck: Path, kind: str, world: int, shapes: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """Full tensors from the per-rank files: sharded ones concatenated along dim 0 in rank order,
    the replicated ones from rank 0."""
    parts = [load_file(str(_rank_file(ck, kind, r))) for r in range(world)]
    out = dict(parts[0])
    for name, shape in shapes.items():
        full = torch.cat([p[name] for p in parts], 0)
        if list(full.shape) != shape:
            raise ValueError(
                f"{ck}: the {world} shards of {name} concatenate to {list(full.shape)}, not {shape}"
            )
        out[name] = full
    return out


def _own_shards(
    ck: Path, kind: str, rank: int, shapes: dict[str, list[int]], like: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """This rank's file as ``DTensor`` s laid out like the live tensors in ``like`` (same dp
    size)."""
    out = load_file(str(_rank_file(ck, kind, rank)))
    for name in shapes:
        ref = like[name]
        out[name] = DTensor.from_local(
            out[name].to(device=ref.to_local().device, dtype=ref.dtype),
            ref.device_mesh,
            ref.placements,
            run_check=False,
            shape=ref.shape,
            stride=ref.stride(),
        )
    return out


def save_engine_checkpoint(
    path: str | Path,
    module: nn.Module,
    optimizer,
    scheduler,
    *,
    model_cfg=None,
    extra: dict[str, Any] | None = None,
    write: bool = True,
    sharded: bool = False,
) -> Path:
    """Atomically write ``module`` + optimizer + scheduler + RNG (+ ``extra`` JSON) to ``path``.

    With an FSDP2-sharded ``module`` every rank of its dp group must call this; pass ``write=True``
    on exactly one rank (rank 0). ``sharded=False``: the full tensors are gathered collectively
    and rank 0 writes them. ``sharded=True``: every rank writes its own shards (the sharded
    format, see the module docstring); an unsharded module is written in the full format.
    Without sharding a call with ``write=False`` does nothing.
    """
    final = Path(path)
    if sharded and is_sharded(module):
        return _save_sharded(final, module, optimizer, scheduler, model_cfg, extra)
    if not write:
        if is_sharded(module):  # take part in the gathers, keep nothing
            _full_model_state(module, keep=False)
            _optim_split(optimizer, keep=False)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(_full_model_state(module), str(tmp / "model.safetensors"))
    otensors, ometa = _optim_split(optimizer)
    save_file(otensors, str(tmp / "optim.safetensors"))
    rtensors, rmeta = _rng_state()
    save_file(rtensors, str(tmp / "rng.safetensors"))
    state = {
        "optimizer": ometa,
        "scheduler": _sched_state(scheduler),
        "rng": rmeta,
        "extra": dict(extra or {}),
        "model_cfg": dataclasses.asdict(model_cfg) if model_cfg is not None else None,
    }
    (tmp / "state.json").write_text(json.dumps(state))
    _swap_into(tmp, final)
    return final


def load_engine_checkpoint(
    path: str | Path, module: nn.Module, optimizer, scheduler
) -> dict[str, Any]:
    """Restore what :func:`save_engine_checkpoint` wrote; returns the ``extra`` dict.

    Works for any strategy/dp size and either format: sharded parameters and optimizer moments
    are cut from the full tensors locally on each rank; a sharded checkpoint resumed with the dp
    size it was written with reads only this rank's files.
    """
    p = Path(path)
    if not (p / "state.json").exists():
        raise FileNotFoundError(f"{p} is not a postrl engine checkpoint (no state.json)")
    state = json.loads((p / "state.json").read_text())
    if state.get("format", "full") == "sharded":
        world, ms, os_ = state["world_size"], state["model_shapes"], state["optim_shapes"]
        rank, here = _sharded_group(module)[1:] if is_sharded(module) else (0, 1)
        if is_sharded(module) and here == world:
            sd, groups = _aliases(module)
            live = {sorted(names)[0]: sd[names[0]] for names in groups}
            params = [q for g in optimizer.param_groups for q in g["params"]]
            olive = {
                k: params[int(k.partition(".")[0])] for k in os_
            }  # moments are laid out like their param
            model_t = _own_shards(p, "model", rank, ms, live)
            optim_t = _own_shards(p, "optim", rank, os_, olive)
        else:
            model_t, optim_t = _merged(p, "model", world, ms), _merged(p, "optim", world, os_)
        _load_model_state(module, model_t, p)
    else:
        _load_model_state(module, load_file(str(p / "model.safetensors")), p / "model.safetensors")
        optim_t = load_file(str(p / "optim.safetensors"))
    optimizer.load_state_dict(_optim_join(optim_t, state["optimizer"], optimizer))
    sched = dict(scheduler.state_dict())
    sched.update(state["scheduler"])
    scheduler.load_state_dict(sched)
    _set_rng(load_file(str(p / "rng.safetensors")), state["rng"])
    return state["extra"]


def export_hf(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a plain Hugging Face model directory from an actor checkpoint (LoRA merged).

    ``ckpt_dir`` may be the actor checkpoint itself or a step directory holding ``actor/``.
    Tokenizer files are copied from the original ``model.path``.
    """
    from postrl.engine.model import ModelSpec, load_policy

    ck = Path(ckpt_dir)
    if not (ck / "state.json").exists() and (ck / "actor" / "state.json").exists():
        ck = ck / "actor"
    state = json.loads((ck / "state.json").read_text())
    if not state.get("model_cfg"):
        raise ValueError(f"{ck} has no model_cfg in state.json; it is not an actor checkpoint")
    known = {f.name for f in dataclasses.fields(ModelSpec)} - {"gradient_checkpointing"}
    mcfg = ModelSpec(
        **{k: v for k, v in state["model_cfg"].items() if k in known},
        gradient_checkpointing=False,
    )
    policy = load_policy(mcfg, "cpu")
    if state.get("format", "full") == "sharded":
        tensors = _merged(ck, "model", state["world_size"], state["model_shapes"])
    else:
        tensors = load_file(str(ck / "model.safetensors"))
    _load_model_state(policy.module, tensors, ck)
    return save_hf(policy, mcfg.path, out_dir)


def save_hf(policy, source_path: str | Path, out_dir: str | Path) -> Path:
    """Save a :class:`PolicyModel` as a plain HF directory (LoRA merged, attention ``sdpa``),
    copying tokenizer and generation files from ``source_path``. Written atomically."""
    lm = policy.module.merge_and_unload() if policy.is_lora else policy.module
    prev = lm.config._attn_implementation
    lm.config._attn_implementation = "sdpa"
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        lm.save_pretrained(tmp, safe_serialization=True)
    finally:
        lm.config._attn_implementation = prev
    for f in Path(source_path).iterdir():
        if f.name.startswith(
            (
                "tokenizer",
                "special_tokens",
                "vocab",
                "merges",
                "generation_config",
                "chat_template",
                "postrl_model",
            )
        ):
            shutil.copy2(f, tmp / f.name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
