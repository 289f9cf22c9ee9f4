"""Weight generator, checkpoint resume, HF export, critic, and the workers on the local backend."""

from __future__ import annotations

import dataclasses

import torch
from safetensors.torch import load_file

from postrl.config.schema import ModelConfig, PostRLConfig
from postrl.controller import create_worker_group
from postrl.engine.checkpoint import export_hf, iter_hf_params
from postrl.engine.model import load_policy
from postrl.workers import ActorWorker, CriticWorker


def test_weight_generator_names_and_values(tiny_model_dir):
    pol = load_policy(ModelConfig(path=str(tiny_model_dir)))
    sd = pol.causal_lm.state_dict()
    got = list(iter_hf_params(pol))
    names = [n for n, _ in got]
    assert len(names) == len(set(names)), "a tensor was yielded twice"
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(names) == set(on_disk), (
        "names must be the HF checkpoint's (tied lm_head not repeated)"
    )
    for n, t in got:
        assert torch.equal(t, sd[n]), n


def test_weight_generator_lora_merges(tiny_model_dir):
    pol = load_policy(ModelConfig(path=str(tiny_model_dir), lora_rank=4))
    with torch.no_grad():
        for n, p in pol.module.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # peft initialises B = 0; make the delta visible
    merged = dict(iter_hf_params(pol))
    on_disk = load_file(str(tiny_model_dir / "model.safetensors"))
    assert set(merged) == set(on_disk)
    ref = pol.module.merge_and_unload().state_dict()
    diff = [n for n in merged if not torch.equal(merged[n], on_disk[n])]
    assert diff, "LoRA delta not merged"
    for n, t in merged.items():
        torch.testing.assert_close(t, ref[n], atol=1e-6, rtol=0)


def _cfg(model_dir, **actor):
    cfg = PostRLConfig()
    cfg.model.path = str(model_dir)
    cfg.rollout.n = 4
    cfg.actor.ppo_mini_batch_size = 2
    cfg.actor.optim.lr = 1e-3
    cfg.critic.ppo_mini_batch_size = 2
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    return cfg


def test_checkpoint_resume_identical_next_step(tiny_model_dir, make_batch, tmp_path):
    """save → load into a fresh worker → the next update is bit-identical to the uninterrupted
    one."""
    cfg = _cfg(tiny_model_dir, shuffle=True)
    b1, b2 = make_batch(2, 4, seed=11), make_batch(2, 4, seed=12)
    wg = create_worker_group(
        "local", ActorWorker, kwargs={"cfg": cfg, "total_steps": 4}, name="actor"
    )
    b1 = b1.union(wg.compute_log_prob(b1))
    wg.update_actor(b1)
    wg.save_checkpoint(str(tmp_path / "ck"))
    b2 = b2.union(wg.compute_log_prob(b2))
    m_a = wg.update_actor(b2).meta_info["metrics"]
    w_a = dict(iter_hf_params(wg.workers[0].policy))
    torch.manual_seed(123)  # RNG must come back from the checkpoint
    wg2 = create_worker_group(
        "local", ActorWorker, kwargs={"cfg": cfg, "total_steps": 4}, name="actor2"
    )
    wg2.load_checkpoint(str(tmp_path / "ck"))
    m_b = wg2.update_actor(b2).meta_info["metrics"]
    w_b = dict(iter_hf_params(wg2.workers[0].policy))
    assert m_a == m_b
    for n in w_a:
        assert torch.equal(w_a[n], w_b[n]), n
    out = export_hf(tmp_path / "ck", tmp_path / "hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    sd = m.state_dict()
    ck_pol = load_policy(dataclasses.replace(cfg.model))
    from safetensors.torch import load_model

    load_model(ck_pol.module, str(tmp_path / "ck" / "model.safetensors"))
    for n, t in iter_hf_params(ck_pol):
        assert torch.equal(sd[n], t), n
    wg.shutdown()
    wg2.shutdown()


def test_critic_values_and_update(tiny_model_dir, make_batch):
    cfg = _cfg(tiny_model_dir)
    wg = create_worker_group("local", CriticWorker, kwargs={"cfg": cfg}, name="critic")
    batch = make_batch(2, 4, seed=13)
    v = wg.compute_values(batch).batch["values"]
    assert torch.count_nonzero(v) == 0  # zero-initialised head
    batch = batch.union(wg.compute_values(batch))
    batch.batch["returns"] = torch.ones_like(v) * batch.batch["response_mask"]
    m1 = wg.update_critic(batch).meta_info["metrics"]
    m2 = wg.update_critic(batch).meta_info["metrics"]
    assert m1["critic/vf_loss"] > 0 and m1["critic/grad_norm"] > 0
    assert m2["critic/vpred_mean"] > m1["critic/vpred_mean"]  # values move toward the returns
    assert {"critic/vf_clipfrac", "critic/lr"} <= set(m1)
    wg.shutdown()
