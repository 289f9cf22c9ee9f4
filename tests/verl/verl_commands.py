"""verl's documented launch commands, verbatim, and how a test shrinks them to the tiny model."""

from __future__ import annotations

# verl's documented launch commands, argument for argument (docs/start/quickstart.rst;
# examples/grpo_trainer/run_qwen2-7b.sh; examples/grpo_trainer/run_qwen3_8b_fsdp.sh with its
# shell arrays expanded for INFER_BACKEND=vllm on GPUs), after the shell expanded $HOME.
QUICKSTART_PPO = """
data.train_files=$HOME/data/gsm8k/train.parquet
data.val_files=$HOME/data/gsm8k/test.parquet
data.train_batch_size=256
data.max_prompt_length=512
data.max_response_length=512
actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
critic.optim.lr=1e-5
critic.model.path=Qwen/Qwen2.5-0.5B-Instruct
critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001
trainer.logger=console
trainer.val_before_train=False
trainer.n_gpus_per_node=1
trainer.nnodes=1
trainer.save_freq=10
trainer.test_freq=10
trainer.total_epochs=15
""".split()

GRPO_QWEN2_7B = """
algorithm.adv_estimator=grpo
data.train_files=$HOME/data/gsm8k/train.parquet
data.val_files=$HOME/data/gsm8k/test.parquet
data.train_batch_size=1024
data.max_prompt_length=512
data.max_response_length=1024
data.filter_overlong_prompts=True
data.truncation=error
actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2
actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6
actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False
trainer.critic_warmup=0
trainer.logger=["console","wandb"]
trainer.project_name=verl_grpo_example_gsm8k
trainer.experiment_name=qwen2_7b_function_rm
trainer.n_gpus_per_node=8
trainer.nnodes=1
trainer.save_freq=20
trainer.test_freq=5
trainer.total_epochs=15
""".split()

GRPO_QWEN3_8B = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.train_files=['$HOME/data/gsm8k/train.parquet', '$HOME/data/math/train.parquet']",
    "data.val_files=['$HOME/data/gsm8k/test.parquet', '$HOME/data/math/test.parquet']",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen3-8B",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "trainer.balance_batch=True",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_gsm8k_math",
    "trainer.experiment_name=qwen3_8b_grpo_vllm_fsdp_20260101_0000",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
    "ray_kwargs.ray_init.runtime_env.py_executable=null",
]

#: What shrinking a launch command to the tiny model on CPU changes (everything else stays).
SHRINK = {
    "data.train_batch_size": "4",
    "data.max_prompt_length": "256",  # the tiny model's byte tokenizer: one token per byte
    "data.max_response_length": "8",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "2048",
    "actor_rollout_ref.rollout.name": "native",  # vLLM needs a GPU (tested separately)
    "actor_rollout_ref.rollout.n": "2",
    "critic.ppo_micro_batch_size_per_gpu": "4",
    "trainer.n_gpus_per_node": "1",
    "trainer.total_epochs": "1",
}


def shrink(cmd: list[str], home, model, run_dir, extra=()) -> list[str]:
    """``cmd`` with $HOME, the model, sizes and the engine replaced; 2 steps; one run dir."""
    out = []
    for arg in cmd:
        key, _, value = arg.partition("=")
        if key.endswith("model.path"):
            value = str(model)
        value = SHRINK.get(key, value).replace("$HOME", str(home))
        out.append(f"{key}={value}")
    return [
        *out,
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]
