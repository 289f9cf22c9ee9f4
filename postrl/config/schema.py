"""Typed configuration of the whole system: one dataclass per component.

The docstring under every field is the one source of its documentation (``postrl train
--help-config`` and ``docs/config.md`` are generated from it). Defaults are the embedded CPU
defaults: ``postrl train`` with only ``model.path`` and data files runs GRPO on a laptop.

Settings the engine also takes (``model.*``, ``*.optim.*``, the batching and loss keys of
``actor.*`` / ``critic.*``) take their defaults from the engine's specs
(:mod:`postrl.engine.specs`): each default is written once, there.

Batch-size conventions follow verl: ``data.train_batch_size`` and ``actor.ppo_mini_batch_size``
count *prompts*; each prompt yields ``rollout.n`` responses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from postrl.config.distill import DistillConfig
from postrl.engine.specs import BatchSpec, ModelSpec, OptimSpec, PolicyLossSpec


def config_key(f: dataclasses.Field) -> str:
    """The YAML / override key of a config field: its name, or ``metadata["key"]`` where the
    name is a Python keyword (``trainer.async_`` is ``trainer.async``)."""
    return str(f.metadata.get("key", f.name))


@dataclass
class ModelConfig:
    path: str = ModelSpec.path
    """Hugging Face model directory (``postrl make-model`` creates tiny ones)."""
    dtype: str = ModelSpec.dtype
    """dtype the parameters are stored and updated in (gradients and AdamW state follow):
    ``auto``, ``float32``, ``bfloat16`` or ``float16``. ``auto`` is float32 for trained models
    (actor, critic: fp32 master weights) and ``compute_dtype`` for the frozen reference."""
    compute_dtype: str = ModelSpec.compute_dtype
    """dtype of the forward/backward math: ``auto`` (float32 on CPU, bfloat16 on GPU),
    ``float32`` or ``bfloat16``. Narrower than ``dtype`` → mixed precision: FSDP2 units gather
    their parameters in it and reduce gradients in ``dtype`` (``MixedPrecisionPolicy``);
    unsharded models (dp=1, ``ddp``) run their forward under ``torch.autocast``. The LM head's
    logits are cast to float32 before the log-softmax/entropy (as verl does), values likewise."""
    trust_remote_code: bool = ModelSpec.trust_remote_code
    """Passed to ``from_pretrained``; off by default for safety."""
    gradient_checkpointing: bool = ModelSpec.gradient_checkpointing
    """Recompute activations in backward to save memory."""
    lora_rank: int = ModelSpec.lora_rank
    """LoRA rank; 0 disables LoRA (full fine-tuning). With LoRA, the reference policy is the
    same model with adapters disabled (no second copy)."""
    lora_alpha: int = ModelSpec.lora_alpha
    """LoRA scaling numerator."""
    lora_target_modules: str = ModelSpec.lora_target_modules
    """Modules to adapt (peft ``target_modules``)."""
    kernels: str = ModelSpec.kernels
    """The training forward/backward's small ops: ``auto`` (default) runs RMSNorm, the SwiGLU
    activation and the packed attention as fused C kernels on the CPU in float32 when they
    build (``postrl/kernels/``; a C compiler is needed, ``POSTRL_KERNELS=0`` turns them off)
    and torch's ops otherwise; ``fused`` requires them (an error names why they cannot run);
    ``torch`` never uses them. Outputs and gradients agree with torch's ops to float rounding."""


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Parquet files in verl's schema (``postrl data ...`` writes them)."""
    val_files: list[str] = field(default_factory=list)
    """Parquet files for validation (empty: no validation)."""
    train_batch_size: int = 16
    """Prompts per RL step (each yields ``rollout.n`` responses)."""
    val_batch_size: int = 0
    """Prompts per validation batch; 0 = the whole validation set at once."""
    max_prompt_length: int = 256
    """Prompts longer than this (in tokens, after the chat template) are handled per
    ``truncation``."""
    truncation: str = "error"
    """``error`` (name the row) or ``filter`` (drop and count) for over-long prompts."""
    shuffle: bool = True
    """Shuffle the training set each epoch (seeded)."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    max_val_samples: int = 0
    """Use at most this many validation rows (0 = all)."""
    sampler: str = "sequential"
    """Prompt sampler (``postrl.data.samplers.PROMPT_SAMPLERS`` name or ``module:Class``):
    ``sequential`` (each prompt once per epoch), ``difficulty`` (also replays prompts whose
    measured success rate is in the learnable band) or ``greso`` (skips, before rollout, prompts
    whose last visits had all responses scored the same); ``sampler/*`` metrics."""
    sampler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the sampler (``difficulty``: ``replay_fraction``, ``low``,
    ``high``, ``ema``, ``max_replays``, ``success_threshold``; ``greso``: ``explore``,
    ``explore_min``, ``explore_max``, ``explore_step``, ``target_easy``, ``target_hard``,
    ``adapt_every``, ``success_threshold``)."""


@dataclass
class OptimConfig:
    lr: float = OptimSpec.lr
    """Peak learning rate (AdamW)."""
    weight_decay: float = OptimSpec.weight_decay
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: list(OptimSpec.betas))
    """AdamW betas."""
    eps: float = OptimSpec.eps
    """AdamW epsilon."""
    warmup_steps: int = OptimSpec.warmup_steps
    """Linear warmup steps (optimizer steps)."""
    lr_scheduler: str = OptimSpec.lr_scheduler
    """``constant`` or ``cosine`` (after warmup)."""
    min_lr_ratio: float = OptimSpec.min_lr_ratio
    """Cosine floor as a fraction of ``lr``."""
    grad_clip: float = OptimSpec.grad_clip
    """Max global grad norm; a non-finite norm skips the step (counted)."""


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = BatchSpec.ppo_mini_batch_size
    """Prompts per optimizer step (× ``rollout.n`` responses)."""
    ppo_micro_batch_size_per_gpu: int = BatchSpec.ppo_micro_batch_size_per_gpu
    """Responses per forward/backward when ``use_dynamic_bsz`` is off."""
    use_dynamic_bsz: bool = BatchSpec.use_dynamic_bsz
    """Form micro-batches by a token budget instead of a fixed count."""
    ppo_max_token_len_per_gpu: int = BatchSpec.ppo_max_token_len_per_gpu
    """Token budget per micro-batch when ``use_dynamic_bsz``."""
    ppo_epochs: int = BatchSpec.ppo_epochs
    """Passes over each batch."""
    shuffle: bool = BatchSpec.shuffle
    """Shuffle responses before splitting into mini-batches."""
    policy_loss: str = PolicyLossSpec.policy_loss
    """Registered policy loss (``docs/algorithms.md``)."""
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Hyperparameters of the chosen policy loss beyond the clip ratios (e.g. ``tau_pos`` of
    ``sapo``, ``bypass_loss`` of ``bypass_mode``): its typed keyword arguments, checked at
    startup — an unknown or misspelt name is an error with a did-you-mean
    (``docs/algorithms.md`` lists each loss's)."""
    clip_ratio_low: float = PolicyLossSpec.clip_ratio_low
    """PPO clip ε_low."""
    clip_ratio_high: float = PolicyLossSpec.clip_ratio_high
    """PPO clip ε_high (DAPO clip-higher: 0.28)."""
    clip_ratio_c: float = PolicyLossSpec.clip_ratio_c
    """Dual-clip constant c (> 1)."""
    loss_agg_mode: str = PolicyLossSpec.loss_agg_mode
    """Registered loss aggregation mode."""
    entropy_coeff: float = PolicyLossSpec.entropy_coeff
    """Entropy bonus coefficient (with ``entropy_target``: its starting value)."""
    entropy_target: float = PolicyLossSpec.entropy_target
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312): after each update the entropy
    bonus's coefficient rises by ``entropy_coeff_step`` if the update's token-mean entropy was
    below this many nats and falls by it otherwise, within ``[entropy_coeff_min,
    entropy_coeff_max]``; metric ``actor/entropy_coeff``. 0 = off: a fixed ``entropy_coeff``."""
    entropy_coeff_step: float = PolicyLossSpec.entropy_coeff_step
    """How far one update moves the adaptive coefficient (``entropy_target > 0``)."""
    entropy_coeff_max: float = PolicyLossSpec.entropy_coeff_max
    """Upper bound of the adaptive coefficient (``entropy_target > 0``)."""
    entropy_coeff_min: float = PolicyLossSpec.entropy_coeff_min
    """Lower bound of the adaptive coefficient (``entropy_target > 0``): 0 as in Skywork-OR1;
    a fixed bonus known to work (the 3-digit recipe's 0.01) keeps its early protection."""
    use_kl_loss: bool = PolicyLossSpec.use_kl_loss
    """Add a KL(π‖π_ref) loss term (GRPO-style); needs a reference policy."""
    kl_loss_coef: float = PolicyLossSpec.kl_loss_coef
    """Coefficient of the KL loss."""
    kl_loss_type: str = PolicyLossSpec.kl_loss_type
    """Registered KL estimator for the KL loss."""
    skip_zero_advantage: bool = PolicyLossSpec.skip_zero_advantage
    """Leave the rows whose advantages are all 0 out of the update's forward and backward. The
    policy-gradient term is the same (such a row adds 0 to it; the token and sequence counts it
    is normalised by still include every row), to float rounding. What changes: the entropy
    bonus, the KL loss and a distillation term become means over the trained rows only, and so
    do ``actor/entropy`` and the loss's own metrics; a fused update's old log-probs (and the
    ``rollout_corr/*`` metrics measured on them) cover the trained rows only. With GRPO, a
    group whose rewards are all equal and, under ``negative_weight: 0``, every wrong answer has
    zero advantage. Needs a policy loss registered ``zero_advantage_rows_free`` (all built-in
    ones but ``clip_cov``/``kl_cov``). Metric ``actor/zero_adv_skipped_frac``."""
    share_prompt_prefix: bool | None = None
    """Compute the n responses of a prompt against one shared prompt copy (None = auto)."""
    fuse_old_log_prob: bool | None = None
    """On-policy steps (one mini-batch, ppo_epochs=1) take old log-probs from the update's own
    forward (ratio exactly 1) instead of a separate pass. None = on when allowed: one mini-batch
    per step, no KL-in-reward, no rollout IS/rejection. True where not allowed is an error."""
    strategy: str = "fsdp2"
    """Data parallelism when dp > 1 (Ray backend): ``fsdp2`` shards parameters, gradients and
    optimizer state over the ranks (``fully_shard`` per decoder layer); ``ddp`` keeps a full
    replica per rank and sums gradients. Also used by the reference model. No effect at dp = 1."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the policy."""


@dataclass
class CriticConfig:
    ppo_mini_batch_size: int = BatchSpec.ppo_mini_batch_size
    """Prompts per critic optimizer step."""
    ppo_micro_batch_size_per_gpu: int = BatchSpec.ppo_micro_batch_size_per_gpu
    """Responses per forward/backward when ``use_dynamic_bsz`` is off."""
    use_dynamic_bsz: bool = BatchSpec.use_dynamic_bsz
    """Form micro-batches by a token budget."""
    ppo_max_token_len_per_gpu: int = BatchSpec.ppo_max_token_len_per_gpu
    """Token budget per micro-batch."""
    ppo_epochs: int = BatchSpec.ppo_epochs
    """Passes over each batch."""
    cliprange_value: float = 0.5
    """Value clipping range."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the value loss."""
    strategy: str = "fsdp2"
    """Data parallelism when dp > 1: ``fsdp2`` (sharded) or ``ddp`` (replicas); see
    ``actor.strategy``."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer of the critic."""
    model_path: str = ""
    """HF directory the critic starts from (empty: ``model.path``). A reward model works too: its
    backbone and one-label ``score`` head become the critic's backbone and value head (the
    InstructGPT initialisation); a critic exported by postrl restores its value head."""


@dataclass
class RefConfig:
    enable: bool | None = None
    """Compute reference log-probs; None = only when a KL term needs them."""


@dataclass
class GatewayConfig:
    command: str = ""
    """Shell command started once per trajectory (``gateway`` agent loop), e.g.
    ``python my_agent.py``; it reads ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``POSTRL_TASK``
    and ``POSTRL_REWARD_URL`` from its environment (docs/agent.md). Exactly one of ``command``
    and ``entrypoint`` is set."""
    entrypoint: str = ""
    """``module:function`` of an async function called in-process once per trajectory with
    keyword arguments ``base_url, api_key, task, task_path, reward_url`` (the same values as
    the command's environment)."""
    timeout_s: float = 300.0
    """Deadline of one trajectory (the agent's whole run); past it the agent is killed and the
    trajectory is masked and counted in ``agent/gateway_failures``."""
    max_concurrency: int = 16
    """Agents running at once per agent manager (others wait for a slot)."""
    max_requests: int = 32
    """Chat-completion requests one trajectory may make; more are answered with a 400 and the
    trajectory fails (a runaway agent)."""
    output_limit_bytes: int = 65536
    """stdout and stderr kept per agent process (each; the last bytes are kept, the rest is
    counted and dropped)."""
    render_tools: bool = True
    """Render a request's ``tools`` into the prompt with the chat template (OpenAI's meaning).
    False: ``tools`` only turn tool-call parsing on and the prompt is rendered without them —
    for a model that learned its tool format elsewhere (its system prompt, SFT data), e.g. the
    tool-arith recipe."""


def _verifiers_renderer() -> dict[str, Any]:
    return {"name": "default", "tool_parser": "qwen3"}


@dataclass
class VerifiersConfig:
    taskset: str = ""
    """The ``verifiers`` taskset id (``verifiers`` loop): a module importable by the verifiers
    worker (see ``python_path``) that exports its ``vf.Taskset`` subclass via ``__all__``.
    Dataset rows name their task by ``extra_info.verifiers_task_idx`` (``postrl data
    verifiers`` writes such a dataset) or carry its data in ``extra_info.verifiers_task``."""
    env: dict[str, Any] = field(default_factory=dict)
    """More of the verifiers ``EnvConfig``, deep-merged over postrl's defaults
    ``{"agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}`` (the chat
    harness, run on this host), e.g. ``{"id": "best-of-n"}`` or
    ``{"agent": {"harness": {"id": "bash"}}}``."""
    python: str = ""
    """Interpreter of the verifiers venv the worker runs in. Empty: ``.venv-verifiers/bin/python``
    (built by ``make verifiers-venv``) in the working directory or beside the source tree."""
    python_path: list[str] = field(default_factory=list)
    """Directories put first on the worker's ``PYTHONPATH`` (where the taskset module lives; its
    MCP tool servers, started by module name, find it there too)."""
    renderer: dict[str, Any] = field(default_factory=_verifiers_renderer)
    """The ``renderers.RendererConfig`` the verifiers training client tokenises with
    (``default``: the model's chat template; ``tool_parser`` ``qwen3`` reads Hermes
    ``<tool_call>`` JSON, the format of ``rollout.agent.tool_parser=hermes``)."""
    timeout_s: float = 300.0
    """Deadline of one episode; past it the episode is cancelled and the trajectory masked and
    counted in ``agent/verifiers_failures``."""
    startup_timeout_s: float = 180.0
    """Deadline for the worker to import verifiers, load the environment and start serving."""
    max_concurrency: int = 16
    """Episodes running at once per agent manager (others wait for a slot)."""
    max_requests: int = 64
    """Generate calls one episode may make; more are refused and the trajectory fails."""


@dataclass
class EnvConfig:
    gamma: float = 1.0
    """Discount of an environment episode's per-turn rewards (``env_agent`` loop): the
    trajectory's score is ``Σ_t gamma^t r_t``; 1.0 sums them (docs/agent.md, "Environments")."""


@dataclass
class AgentConfig:
    default_agent_loop: str = "single_turn"
    """Agent loop for rows without an ``agent_name`` column."""
    tool_config_path: str = ""
    """YAML tool config for the ``tool_agent`` loop."""
    max_assistant_turns: int = 4
    """Max generation turns per trajectory (tool loop)."""
    max_user_turns: int = 4
    """Max tool/user observation turns per trajectory."""
    max_tool_response_length: int = 256
    """Tool responses are truncated to this many characters."""
    tool_parser: str = "hermes"
    """Tool-call format of the policy's replies (a ``TOOL_PARSERS`` name): hermes, qwen3_coder,
    gpt-oss, llama3_json, mistral, deepseek_v3, deepseek_v31, glm45 or kimi_k2
    (``docs/tools.md``)."""
    check_token_faithfulness: bool = False
    """Compare trained ids with apply_chat_template of the conversation
    (agent/token_drift_ratio)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """Bring-your-own-agent loop (``gateway``): an OpenAI-compatible endpoint per trajectory
    for an agent program (docs/agent.md, "Bring your own agent")."""
    verifiers: VerifiersConfig = field(default_factory=VerifiersConfig)
    """``verifiers`` environments (``verifiers`` loop): episodes run by a verifiers worker in
    its own venv against the gateway's token route (docs/agent.md, "verifiers environments")."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Gym-style environment loop (``env_agent``): one episode per trajectory, turns bounded by
    ``max_assistant_turns``, observations cut to ``max_tool_response_length`` characters."""


@dataclass
class ValKwargs:
    n: int = 1
    """Samples per validation prompt (pass@k uses them)."""
    temperature: float = 0.0
    """0 = greedy validation."""
    top_p: float = 1.0
    """Nucleus sampling in validation."""


@dataclass
class RolloutConfig:
    backend: str = "native"
    """Registered rollout backend: ``native`` (CPU default), ``hf``, ``vllm``, ``sglang``."""
    n: int = 8
    """Responses per prompt (GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature (also applied when recomputing log-probs)."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    response_length: int = 16
    """Max new tokens per turn/response."""
    num_replicas: int = 1
    """Inference engine replicas behind the load balancer."""
    max_num_seqs: int = 256
    """Max concurrent sequences per replica (KV slots)."""
    max_model_len: int = 0
    """KV capacity per sequence; 0 = max_prompt_length + response_length (+ agent turns)."""
    free_cache_engine: bool = True
    """Release the KV cache while training (sleep/wake)."""
    weight_sync: str = "naive"
    """Registered weight-sync backend (``naive``: tensors handed over in process; ``bucketed``:
    fixed-size byte buckets; ``nccl``: GPU broadcast). Honoured on every trainer backend: with
    ``trainer.backend=ray`` the actor streams bucket frames one at a time either way."""
    weight_bucket_mb: float = 64.0
    """Bucket size of bucketed weight streams (and of the Ray actor's frames), in MiB."""
    verify_weights: bool = True
    """Verify every weight sync before anything generated from it is trained: per-tensor
    CRC-32 as sent vs as each replica loaded it, and each replica's log-probs of a fixed probe
    sequence vs the trainer's (tolerance per backend and dtype); a mismatch is resent once, a
    second one stops the run naming the tensor or probe token and the engine
    (``weight_sync/*`` metrics; docs/rollout.md, "Weight sync")."""
    verify_probe_every: int = 10
    """With ``verify_weights``: the functional probe (a replica's log-probs of a fixed sequence
    against the trainer's) runs at the first sync, at every ``verify_probe_every``-th sync after
    it, at the first sync a replica takes part in (a restarted or added one) and on every
    resend; the transport checksums are checked at every sync. What the probe catches beyond
    the checksums — a tensor loaded into the wrong place, a stale tied head — is wrong from the
    first sync on; probing each sync costs a short generation and a trainer forward
    (≈ 20 ms of a 0.3 s W1 step). 1 probes every sync, as ``trainer.deterministic=true`` does
    (the probe turns the event loop at a fixed point of the reproduced schedule)."""
    weight_sync_timeout_s: float = 600.0
    """Deadline of one weight push and of its verification: past it the run stops with a
    ``WeightSyncTimeoutError`` naming the engine, never hangs."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent loop settings."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling used by validation."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra backend-specific options (e.g. vLLM ``gpu_memory_utilization``)."""
    python: str = ""
    """Interpreter of the replica processes of a backend that runs in a process of its own
    (``vllm``: its venv pins packages the trainer's cannot hold). Empty: the backend's default
    (``vllm``: ``.venv-vllm/bin/python``, built by ``make vllm-venv``, when it exists; else this
    interpreter)."""


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    """``fixed`` or ``adaptive`` (Ziegler et al. 2019)."""
    kl_coef: float = 0.001
    """Initial/fixed KL coefficient."""
    target_kl: float = 0.1
    """Adaptive controller target."""
    horizon: int = 10000
    """Adaptive controller horizon."""


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = None
    """Truncated importance weights: None, ``token`` or ``sequence``."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the IS weights."""
    rollout_rs: str | None = None
    """Rejection sampling: None, ``sequence`` or ``geometric``."""
    rollout_rs_threshold: float = 2.0
    """Upper rejection threshold of the ratio."""
    rollout_rs_threshold_lower: float = 0.5
    """Lower rejection threshold of the ratio."""
    bypass_mode: bool = False
    """Use rollout log-probs as old log-probs (skip the recompute)."""


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    refill: bool = True
    """Refill exactly: for every dropped group draw one more prompt from the loader, generate
    and score it, until ``data.train_batch_size`` informative groups are kept (so every update
    sees a full batch). False: train on the shrunk batch."""
    max_num_gen_batches: int = 10
    """Generation rounds per step before giving up on a full batch (the step then trains on the
    groups it kept, with a warning and ``dynamic_sampling/refill_exhausted``); 0 = no limit."""
    oversample: bool = False
    """Keep enough groups generating to fill the batch at the measured keep rate: while a step
    gathers its batch, ⌈missing groups / keep rate⌉ groups are in flight (the rate is the kept
    share of the groups scored in the last steps), not one refill per filtered group — the
    engine runs full batches instead of a thinning tail. Groups left over when the batch is
    full are evicted as ``surplus`` (``replay/evicted/surplus``) and their prompts are generated
    again first at the next step: nothing is lost, the leftover compute is. Modes that declare
    ``oversample`` in their registry entry (``sync``), on either data plane; no
    effect without ``enable`` and ``refill``."""


@dataclass
class DownsampleConfig:
    enable: bool = False
    """Rollout down-sampling (PODS, Xu et al. 2025, arXiv 2504.13818): generate ``rollout.n``
    responses per prompt, train on ``size`` of them (advantages are computed on the subset). The
    update costs ``size``/``rollout.n`` of a full group's; the generation stays cheap."""
    size: int = 0
    """Responses kept per group, ``2 <= size < rollout.n``; mini-batches count
    ``ppo_mini_batch_size × size`` responses."""
    rule: str = "max_variance"
    """``max_variance`` (PODS: the subset whose rewards vary most, e.g. every correct answer
    plus as many wrong ones) or ``random`` (the control arm)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Registered advantage estimator (``docs/algorithms.md``)."""
    adv_estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    """Hyperparameters of the chosen estimator beyond ``gamma``/``lam``/
    ``norm_adv_by_std_in_grpo`` (e.g. ``epsilon`` of ``grpo``, ``f_norm`` of ``gpg``,
    ``handle_zero_tail`` of ``optimal_token_baseline``): its typed keyword arguments, checked
    at startup — an unknown or misspelt name is an error with a did-you-mean."""
    gamma: float = 1.0
    """Discount (GAE)."""
    lam: float = 1.0
    """GAE λ."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group std (False = Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract β·KL(π_old‖π_ref) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """KL coefficient controller."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Training/inference mismatch correction."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    downsample: DownsampleConfig = field(default_factory=DownsampleConfig)
    """Train on a subset of each group's responses (PODS)."""


@dataclass
class CustomRewardConfig:
    path: str = ""
    """Python file holding the user's reward function."""
    name: str = "compute_score"
    """Function name in that file."""
    batch: bool = False
    """The function takes lists (data_sources, solution_strs, ground_truths, extra_infos) and
    returns a list."""


@dataclass
class OverlongConfig:
    enable: bool = False
    """DAPO soft overlong punishment."""
    buffer_len: int = 4
    """Length of the penalty ramp before the max length."""
    penalty_factor: float = 1.0
    """Penalty at the max length."""


@dataclass
class RewardModelConfig:
    enable: bool = False
    """Score responses with a learned reward model (a Hugging Face sequence-classification
    model with one label, e.g. ``postrl make-model --head reward`` or ``postrl rm``'s output)."""
    path: str = ""
    """Reward model directory (its own tokenizer and chat template are used)."""
    mode: str = "replace"
    """``replace``: the reward model's score is the reward (verl's behaviour; rule functions are
    not called). ``add``: rule/custom reward + ``weight`` × reward-model score."""
    weight: float = 1.0
    """Multiplier of the reward-model score (both modes)."""
    max_length: int = 1024
    """Token budget per scored conversation; longer ones keep their last ``max_length`` tokens
    (the response end) and are counted in ``reward_model/truncated``."""
    micro_batch_size: int = 64
    """Conversations per reward-model forward (padding-free, each distinct prompt computed once)."""


@dataclass
class RewardConfig:
    custom_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    """A user reward function (verl signature), used instead of the data_source registry."""
    timeout_s: float = 10.0
    """Per-sample deadline; a hung function is killed."""
    num_workers: int = 2
    """Worker processes for user reward functions."""
    max_failure_ratio: float = 0.5
    """Stop the run when more than this fraction of a batch fails to score."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to every reward function call (e.g. ``format_score``)."""
    isolate_builtin: bool = False
    """Run even the built-in rule functions in killable worker processes."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """Overlong reward shaping."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """A learned reward model (off by default)."""
    tool_reward_weight: float = 1.0
    """Multiplier of the tool rewards of a trajectory (the sum of its tools' ``reward_delta`` and
    ``calc_reward``), added to its score. 0 ignores tool rewards."""


@dataclass
class AsyncConfig:
    """``trainer.async.*`` (the YAML key is ``async``; in Python the field is ``async_``): how an
    off-policy mode (``one_step_off``, ``fully_async``) keeps its batches within a staleness
    bound, and how ``fully_async`` runs its rollout replicas."""

    max_staleness: int = 1
    """The most policy versions a trained group may lag: its age is the current version minus
    the oldest version among its tokens (not the step it was dispatched at). 0 = on-policy
    (``sync``); ``one_step_off`` needs at least 1."""
    staleness_strategy: str = "drop"
    """``drop``: evict complete groups older than the bound (whole groups; each prompt is
    generated again on the current weights, so it is still trained once in its epoch);
    ``wait``: never drop — the update waits for groups it can train within the bound."""
    score_on_completion: bool | None = None
    """Score each group as it completes (true) or the taken batch at once in the step's reward
    stage, as ``sync`` does (false). At completion the reward stage runs once per set of groups
    that finish together, beside the generation: what a batch reward function or a reward
    model costs is hidden behind it, and a group past ``reward.max_failure_ratio`` is evicted
    and generated again. At the take it runs once per step (on W1 it cost ``one_step_off`` ≈ 3 %
    of its step to score group by group, docs/async.md), and reward failures are ``sync``'s: the
    failed rows are masked and a batch past the ratio stops the run. None (auto): at completion
    with ``algorithm.filter_groups.enable`` (DAPO needs the scores to evict), a reward model, or
    a batch reward function (``reward.custom_function.batch`` or a registered one); at the take
    otherwise. A data plane whose replicas score the groups always scores at completion."""
    take_order: str = "auto"
    """Which complete groups a take may choose. ``completion``: any complete group within the
    bound (``trainer.sampler`` picks): what finishes first trains first, so on a workload whose
    trajectories differ in time (tool calls, long answers) the trained batches lean towards the
    fast ones, and slow groups may turn stale and be dropped. ``admission``: a take waits for the
    ``data.train_batch_size`` groups admitted first and trains exactly those (verl's one-step-off
    batches): no group overtakes another, so what is trained does not depend on how long it took
    to generate; the wait for a batch's slowest group is what it costs. ``auto``: the mode's own
    (its registered ``take_order``: ``one_step_off`` admission, ``fully_async`` completion), or
    completion when ``trainer.sampler`` names another sampler than ``oldest_first``."""
    num_warmup_batches: int = 0
    """Extra batches kept in flight beyond the next one (``1 + num_warmup_batches`` batches are
    generated ahead of training; needs ``max_staleness >= 1 + num_warmup_batches``)."""
    timeout_s: float = 600.0
    """Deadline of one wait for a training batch (typed error naming what it waited for)."""
    parameter_sync_step: int = 1
    """``fully_async``: optimizer steps (one PPO mini-batch each) between two weight pushes;
    ``data.train_batch_size`` must equal ``parameter_sync_step × actor.ppo_mini_batch_size``
    (verl's ``trigger_parameter_sync_step``)."""
    rollout_threads: int = 1
    """``fully_async``: torch threads of each rollout replica process (the trainer keeps
    ``trainer.num_threads``; 0 there = the cores the replicas leave)."""
    rollout_nice: int = 0
    """``fully_async``: niceness added to each rollout replica's process (0-19; ``os.nice``).
    With the trainer on every core (``trainer.num_threads`` = the cores) a positive value lets
    the OS run the replicas on the cycles training leaves idle."""
    replica_health_interval_s: float = 1.0
    """``fully_async``: seconds between two health pings of each rollout replica."""
    replica_health_timeout_s: float = 5.0
    """``fully_async``: a replica whose process is gone is declared dead at once; one that
    answers no health ping for this long while its process makes no CPU progress (stopped,
    deadlocked) is declared hung, hence dead (its in-flight requests go to the others). A replica
    that is silent but working (a loaded machine) is spared until
    ``replica_busy_timeout_s``."""
    replica_busy_timeout_s: float = 0.0
    """``fully_async``: silence after which a replica is declared dead even though its process
    keeps using CPU (a livelock, or a machine too loaded to serve); 0 = ``max(10 ×
    replica_health_timeout_s, 60)``. CPU progress is read for replicas on this machine only;
    elsewhere ``replica_health_timeout_s`` alone decides."""
    idle_switch: str = "never"
    """``fully_async``: the trainer's cores generate while it would wait for samples (verl's
    ``hybrid_rollout``). ``never``; ``auto``: switch at a step whose batch is not complete when
    the predicted wait (moving average of measured waits) exceeds the measured cost of a switch
    in and out; ``always``: whenever the batch is not complete. Local backend only."""
    data_plane: str = "driver"
    """Where finished trajectories travel. ``driver``: back to the trainer process, which
    scores them and builds the batch. ``object_store`` (``trainer.backend=ray``; every mode
    that declares it: ``sync``, ``one_step_off``, ``fully_async``): rollout replica actors of
    their own run the agent loops and the reward and put each scored group into Ray's object
    store; the driver keeps references and tags (lengths, score, policy versions) and each
    training worker fetches and pads its own shard. Stages that read tensors on the driver
    (GAE with a critic, KL in the reward, token-level estimators, downsampling, rejection
    sampling) get the taken groups fetched there; what is refused is the plane's table below
    ("Data planes", ``docs/async.md``)."""
    max_replica_restarts: int = 2
    """``fully_async``: how many dead rollout replicas the run starts again (over the whole
    run; 0 = never). A restart begins at the next step after the death, in the background,
    and the new replica joins right after a later push with that push's weights (at once, with
    the actor's current weights, when no replica is left)."""


@dataclass
class HealthConfig:
    """``trainer.health.*``: alerts on a run's health — off-policy weights, staleness, and
    batches without learning signal (one warning line each, plus ``health/alerts/*`` metrics)."""

    min_ess_ratio: float = 0.0
    """Alert when the effective sample size of the token-level importance weights over N
    (``health/ess_ratio``) falls below this (0 = off)."""
    staleness_alert_steps: int = 3
    """Alert when the mean staleness sits at ``trainer.async.max_staleness`` for this many
    steps in a row (0 = off)."""
    no_signal_alert_steps: int = 3
    """Alert when every trained token's advantage is 0 (every group's rewards equal: no policy
    gradient) for this many steps in a row (0 = off): a collapsed policy, or a solved task."""


@dataclass
class TrainerConfig:
    backend: str = "local"
    """``local`` (in-process workers) or ``ray``."""
    mode: str = "sync"
    """Registered trainer mode: ``sync`` (generate, then train, every step), ``one_step_off``
    (the next batches generate while the current one trains) or ``fully_async`` (alias
    ``separate_async``: rollout replicas in processes of their own generate continuously, one
    mini-batch per step, weights pushed every ``async.parameter_sync_step`` steps); see
    ``docs/async.md``."""
    async_: AsyncConfig = field(default_factory=AsyncConfig, metadata={"key": "async"})
    """Off-policy modes (YAML key ``async``)."""
    sampler: str = "oldest_first"
    """Which complete groups an update takes (a ``postrl.trainer.asynchronous.replay.SAMPLERS``
    name or ``module:Class``)."""
    deterministic: bool = False
    """``one_step_off`` follows a fixed interleaving (groups are scored inline, in-flight
    trajectories restart at a checkpoint), so a resumed run reproduces the uninterrupted one bit
    for bit on CPU. ``sync`` is deterministic on CPU either way."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Off-policy health alerts."""
    num_workers: int = 1
    """Data-parallel training workers (ray backend)."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    total_steps: int = 20
    """RL steps to run (0 = derive from total_epochs; in ``fully_async`` a step trains one
    mini-batch, so an epoch is ``parameter_sync_step`` × as many steps)."""
    total_epochs: int = 1
    """Epochs over the training set when total_steps is 0."""
    test_freq: int = 5
    """Validate every this many steps (0 = only at the end)."""
    time_budget_s: float = 0.0
    """Stop after this many seconds of training (0 = no limit): the sum of the steps' wall
    times (``perf/train_time_s``), validation and checkpoints excluded, carried across resumes. The
    step that crosses it is the last (validated, and saved if ``save_freq``). ``total_steps``
    still caps the run and sets the LR schedule's horizon."""
    test_at_s: list[float] = field(default_factory=list)
    """Also validate at the first step whose ``perf/train_time_s`` reaches each of these seconds of
    training (e.g. ``[120, 300, 600]``: accuracy at 2, 5 and 10 minutes of training)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    save_freq: int = 0
    """Checkpoint every this many steps (0 = never)."""
    checkpoint_format: str = "full"
    """``full``: rank 0 gathers and writes whole tensors (one file set, resumable at any dp size).
    ``sharded``: every FSDP2 rank writes its own shards, no gathers and no full copy in any
    process (for models whose full state does not fit one host's memory); resumable at any dp
    size too, and ``postrl export`` merges it. Multi-node runs need ``run_dir`` on a shared
    filesystem. Unsharded models are always written ``full``."""
    resume_mode: str = "auto"
    """``auto`` (newest complete checkpoint in run_dir), ``disable`` or a checkpoint path."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, plots/ and checkpoints/ go."""
    seed: int = 0
    """Seed of everything (data order, init, sampling seeds)."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Registered metric sinks: console, jsonl, tensorboard, wandb."""
    balance_batch: bool = True
    """Karmarkar-Karp reorder before dispatch so dp ranks get equal token loads."""
    num_threads: int = 0
    """torch threads per process (0 = leave torch's default)."""
    flush_denormal: bool = True
    """Flush fp32 denormals (magnitudes below 1.2e-38) to zero on the CPU in the trainer's
    processes (x86 FTZ/DAZ, ``torch.set_flush_denormal``), set before their first torch op.
    An RL update's gradients underflow into denormals, which x86 cores compute 10-100x slower:
    on a W1-shaped batch the backward GEMMs of the K/V projections ran 10x slower than the
    same shapes without them, the update took 1.6x as long, and W1's update 1.27x
    (docs/benchmarks.md). Only values below 1e-38 change. False: IEEE gradual underflow
    (torch's default)."""
    freeze_gc: bool = True
    """Keep Python's cyclic garbage collector off the objects that exist when training starts
    (the models, torch's and transformers' modules, the dataset): collect once, then
    ``gc.freeze`` them for the run (``postrl.protocol.heap``) in the trainer's process (a
    rollout replica process always freezes its loaded engine). Without it, each full
    collection walked ≈ 430 000 objects for 157-173 ms on W1, stalling one step in fifteen
    (docs/async.md). False: CPython's default collector."""
    lend_cores: bool = True
    """Rollout replica processes on this machine (``fully_async``'s, a ``vllm`` replica's;
    ``trainer.backend=local``, ``trainer.device=cpu``, and ``trainer.num_threads`` plus the
    replicas' ``trainer.async.rollout_threads`` within the machine's cores, so that borrowing
    never oversubscribes them) lend their cores to the trainer while
    they have no request in flight: the actor's forward and backward run on
    ``trainer.num_threads`` plus the idle replicas' ``trainer.async.rollout_threads``, switched
    between decoder layers, and a replica that gets work has its cores back within one layer
    (:mod:`postrl.protocol.cores`). On W1 the trainer is the bound and the replica idles ~80 %
    of the time. ``async/cores_borrowed_s``, ``rollout/core_wait_s``. False: each keeps its own."""
    project_name: str = "postrl"
    """Run grouping for W&B/TensorBoard."""
    experiment_name: str = "default"
    """Run name for W&B/TensorBoard."""


@dataclass
class PostRLConfig:
    """The whole configuration of one run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (``postrl/config/distill.py``)."""

    @property
    def train_group_size(self) -> int:
        """Responses per group that reach the update: ``algorithm.downsample.size`` when
        down-sampling, else ``rollout.n``."""
        ds = self.algorithm.downsample
        return ds.size if ds.enable else self.rollout.n
