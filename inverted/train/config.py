"""The trainer's flags: ``TrainConfig`` and the sections it hands whole to their owners (the loss, the
optimizer, parallelism, weight sync, checkpoints, the adapter, MoE); ``ExportConfig`` for
``inverted export``. Their flags stay flat (``--lr``, not ``--optim-lr``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from inverted.config import (
    CHAT_TEMPLATE_HELP,
    PLUGIN_ARGS_HELP,
    flag_name,
    option,
    require,
)
from inverted.types import PauseMode


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The RL objective: advantages, the surrogate and its clipping, KL, entropy and importance weights."""

    advantage_estimator: Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        option("grpo", "how rewards become per-token advantages, and which surrogate is optimised")
    )
    disable_grpo_std_normalization: bool = option(
        False, "group advantages are reward - mean, not divided by std (Dr. GRPO)"
    )
    gamma: float = option(1.0, "discount of the reinforce_plus_plus returns")
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = option(
        "token_mean", "how per-token losses become one number (seq_mean_token_sum: Dr. GRPO)"
    )
    eps_clip: float = option(0.2, "PPO clip range below 1")
    eps_clip_high: float | None = option(None, "PPO clip range above 1 (default: --eps-clip; DAPO's clip-higher)")
    eps_clip_c: float | None = option(None, "dual-clip bound (> 1) on the loss of negative-advantage tokens")
    use_kl_loss: bool = option(False, "add a KL-to-reference term to the loss")
    kl_loss_coef: float = option(0.0, "weight of the KL loss")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = option("low_var_kl", "KL estimator")
    kl_coef: float = option(0.0, "KL to the reference as a reward penalty (k1, per token)")
    entropy_coef: float = option(0.0, "weight of the entropy bonus")
    use_tis: bool = option(False, "truncated importance sampling with the rollout log-probs")
    tis_clip: float = option(2.0, "upper clip of the TIS weight")
    tis_clip_low: float = option(0.0, "lower clip of the TIS weight")
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "leave out of the loss the tokens of a sample that older weights sampled before its last weight "
        "update (a partial rollout trains only on its newest policy's tokens)",
    )
    rollout_temperature: float = option(1.0, "sampling temperature; training log-probs use the same")
    reward_key: str | None = option(None, "key of a dict reward to train on (default: the sum of its values)")
    loss_type: Literal["policy_loss", "custom_loss", "sft_loss"] = option(
        "policy_loss",
        "the RL surrogate above, --custom-loss-function-path's loss (slime's custom_loss), or the "
        "negative log-likelihood of the trained tokens (slime's sft_loss, e.g. with "
        "slime.rollout.sft_rollout)",
    )
    custom_loss_function_path: str | None = option(
        None,
        "module:function(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), with --loss-type custom_loss",
    )
    custom_tis_function_path: str | None = option(
        None,
        "module:function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw) -> "
        "(pg_loss, loss_masks, metrics): importance weights in place of --use-tis's (turns TIS on)",
    )
    custom_pg_loss_reducer_function_path: str | None = option(
        None,
        "module:get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> "
        "reducer: how the policy-gradient term is reduced (e.g. Dr. GRPO's constant divisor)",
    )
    custom_reward_post_process_path: str | None = option(
        None,
        "module:function(samples) -> rewards (slime's (args, samples) -> (raw_rewards, rewards)): the rewards "
        "that become advantages, in place of the group normalisation",
    )
    raw_rewards: bool = option(
        False,
        "advantages from the rewards as they are, with no group baseline (slime's --disable-rewards-normalization)",
    )
    per_token_loss: bool = option(
        False,
        "a custom pg-loss reducer's value is divided by the step's trained tokens "
        "instead of its samples, as Megatron's per-token loss (slime's "
        "--calculate-per-token-loss)",
    )
    distill: Literal["none", "samples", "teacher"] = option(
        "none",
        "on-policy distillation: each token's advantage loses --distill-kl-coef x (its old log-prob - the "
        "teacher's); the teacher's log-probs come with the Samples (teacher_log_probs, which a reward "
        "post-process sets), or from --distill-teacher, which the trainer runs (slime's --use-opd)",
    )
    distill_teacher: str | None = option(
        None, "the teacher's HF checkpoint for --distill teacher, of the policy's architecture", path=True
    )
    distill_kl_coef: float = option(1.0, "the weight of on-policy distillation's reverse KL in the advantages")

    def __post_init__(self) -> None:
        require(
            self.loss_type != "custom_loss" or bool(self.custom_loss_function_path),
            "--custom-loss-function-path",
            self.custom_loss_function_path,
            "a module:function with --loss-type custom_loss",
        )
        require(0 < self.eps_clip, "--eps-clip", self.eps_clip, "> 0")
        require(self.eps_clip_high is None or self.eps_clip_high > 0, "--eps-clip-high", self.eps_clip_high, "> 0")
        require(self.eps_clip_c is None or self.eps_clip_c > 1, "--eps-clip-c", self.eps_clip_c, "> 1")
        require(self.rollout_temperature > 0, "--rollout-temperature", self.rollout_temperature, "> 0")
        require(0 <= self.tis_clip_low <= self.tis_clip, "--tis-clip-low", self.tis_clip_low, "0 <= it <= --tis-clip")
        require(
            not (self.kl_coef and self.use_kl_loss and self.kl_loss_coef),
            "--kl-coef",
            self.kl_coef,
            "0 when --use-kl-loss has a non-zero --kl-loss-coef (KL as reward or as loss, not both)",
        )
        require(
            (self.distill == "teacher") == bool(self.distill_teacher),
            "--distill-teacher",
            self.distill_teacher,
            "a checkpoint exactly when --distill teacher",
        )

    @property
    def needs_reference(self) -> bool:
        return bool(self.kl_coef) or (self.use_kl_loss and bool(self.kl_loss_coef))


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The optimizer: AdamW through Megatron's optimizer wrapper, with gradient clipping."""

    lr: float = option(1e-6, "learning rate (constant)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.98, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0: no clipping)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks (GPU only)")

    def __post_init__(self) -> None:
        require(self.lr >= 0, "--lr", self.lr, ">= 0")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the trainer is laid out: Megatron's parallel sizes over nodes x processes per node."""

    tensor_model_parallel_size: int = option(1, "Megatron tensor parallelism")
    pipeline_model_parallel_size: int = option(1, "Megatron pipeline parallelism")
    context_parallel_size: int = option(1, "Megatron context parallelism")
    expert_model_parallel_size: int = option(1, "Megatron expert parallelism")
    sequence_parallel: bool = option(
        False,
        "Megatron sequence parallelism: tensor-parallel ranks split the sequence outside attention and the "
        "MLP (less activation memory; needed to tensor-parallelise a Mixture-of-Experts model)",
    )
    actor_num_nodes: int = option(1, "training nodes")
    actor_num_gpus_per_node: int = option(1, "training processes per node (GPUs; CPU processes without CUDA)")
    actor_node_resource: str | None = option(
        None, "a Ray custom resource (ray start --resources) that only the training nodes offer: the ranks go there"
    )

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "actor_num_nodes",
            "actor_num_gpus_per_node",
        ):
            require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")

    def validate(self) -> None:
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        require(
            self.world_size % model_parallel == 0,
            "--actor-num-gpus-per-node",
            self.actor_num_gpus_per_node,
            f"a multiple of tensor x pipeline x context parallel sizes ({model_parallel}) over "
            f"{self.actor_num_nodes} node(s)",
        )

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the rollout servers after a training step."""

    update_weight_transport: Literal["auto", "tensor", "distributed", "disk"] = option(
        "auto", "how new weights reach the rollout servers (auto: tensor when they are on this node, else distributed)"
    )
    update_weight_buffer_size: int = option(
        0,
        "bytes per flattened weight bucket (0: 512 MiB on a GPU, slime's default; 128 MiB on a CPU, where the "
        "buckets are host memory that the trainer and the engines keep mapped between updates)",
    )
    update_weight_disk_dir: str | None = option(
        None,
        "where the disk transport writes weights (default: OUTPUT_DIR/weight_updates; shared storage across nodes)",
        path=True,
    )
    update_weight_timeout: float = option(300.0, "seconds to wait for the servers to join a weight-update group")
    pause_mode: PauseMode = option(
        "retract",
        "how generation pauses for a weight update: abort in-flight requests, retract them (resumed on "
        "the new weights, KV recomputed) or hold them in place",
    )

    def __post_init__(self) -> None:
        require(
            self.update_weight_buffer_size == 0 or self.update_weight_buffer_size >= 1024**2,
            "--update-weight-buffer-size",
            self.update_weight_buffer_size,
            "0 (the device's default) or >= 1 MiB",
        )
        require(self.update_weight_timeout > 0, "--update-weight-timeout", self.update_weight_timeout, "> 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Training checkpoints: where to resume from, where and how often to save."""

    load: str | None = option(
        None,
        "checkpoint directory to resume from (its latest step); overrides the HF weights. One where no save "
        "has finished yet (a job killed before its first) starts from the HF weights at step 0, as slime's does",
        path=True,
    )
    save: str | None = option(None, "directory to write checkpoints into", path=True)
    save_interval: int = option(0, "save every N rollouts (0: only at the end, when --save is set)")
    restart_save_interval: int = option(
        1,
        "keep the trainer's own state every N rollouts in OUTPUT_DIR/restart (the latest only, written while "
        "episodes run), from which a trainer whose rank died restarts; 0: none (it restarts from the last --save "
        "checkpoint, or the start, and trains again every batch since)",
    )

    def __post_init__(self) -> None:
        require(self.save_interval >= 0, "--save-interval", self.save_interval, ">= 0")
        require(self.restart_save_interval >= 0, "--restart-save-interval", self.restart_save_interval, ">= 0")


@dataclass(kw_only=True, slots=True)
class AdapterConfig:
    """LoRA: train a low-rank adapter on frozen base weights, and sync only the adapter (miles' flags)."""

    lora_rank: int = option(0, "LoRA rank (0: full fine-tuning)")
    lora_alpha: float = option(32.0, "LoRA alpha: the adapter's output is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "dropout on the adapter's input")
    target_modules: list[str] = option(
        ["all"],
        "modules to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head; all: the seven "
        "projections (as PEFT's all-linear; add lm_head for the output layer)",
    )
    lora_adapter_path: str | None = option(
        None, "PEFT adapter directory to start from (its own rank, alpha and modules are used)", path=True
    )

    def __post_init__(self) -> None:
        require(self.lora_rank >= 0, "--lora-rank", self.lora_rank, ">= 0")
        require(self.lora_alpha > 0, "--lora-alpha", self.lora_alpha, "> 0")
        require(0 <= self.lora_dropout < 1, "--lora-dropout", self.lora_dropout, "in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0 or bool(self.lora_adapter_path)


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-Experts training: Megatron's load-balancing loss, and routing replay (slime's flags)."""

    moe_aux_loss_coeff: float = option(
        0.0, "weight of Megatron's load-balancing loss (aux_loss), added per MoE layer; reported as train/moe_aux_loss"
    )
    use_rollout_routing_replay: bool = option(
        False,
        "R3: the rollout servers return each token's routed experts, the Samples keep them, and the trainer's "
        "routers send every token to those experts (the gate weights over them are the trainer's own)",
    )
    use_routing_replay: bool = option(
        False,
        "R2: the trainer's forward for the old log-probs records its routing, and every training forward "
        "of the rollout replays it",
    )

    def __post_init__(self) -> None:
        require(self.moe_aux_loss_coeff >= 0, "--moe-aux-loss-coeff", self.moe_aux_loss_coeff, ">= 0")
        require(
            not (self.use_rollout_routing_replay and self.use_routing_replay),
            "--use-routing-replay",
            True,
            "not together with --use-rollout-routing-replay (which replays the rollout's routing instead)",
        )

    @property
    def routing_replay(self) -> bool:
        return self.use_rollout_routing_replay or self.use_routing_replay


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The Megatron trainer: model, batching and precision here; loss, optimizer, parallelism, weight
    sync and checkpoints in sections of their own, each handed to its owner (flags stay flat)."""

    hf_checkpoint: str = option("", "Hugging Face checkpoint the policy (and the KL reference) starts from", path=True)
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP, path=True)  # checkpoints keep it: export-hf ships it
    output_dir: str = option(
        "runs/train", "run directory: metrics.jsonl, TensorBoard events, the resolved config", path=True
    )
    num_rollout: int = option(1, "rollouts to train on")
    debug_train_only: bool = option(False, "train from --load-debug-rollout-data with no rollout servers")
    load_debug_rollout_data: str | None = option(
        None,
        "jsonl of Samples to train on (one per line), or slime's .pt dump; '{rollout_id}' in the path picks a "
        "file per rollout",
        path=True,
    )
    global_batch_size: int = option(0, "samples per optimizer step (0: the whole rollout batch in one step)")
    max_tokens_per_gpu: int = option(4096, "token budget of one packed micro-batch")
    logprob_chunk_size: int = option(
        1024,
        "tokens whose logits exist at once when the loss takes log-probs: the output layer and the softmax run "
        "chunk by chunk, recomputed in backward (0: the whole micro-batch's logits at once; a --custom-loss-"
        "function-path plug-in, which reads them, always gets them)",
    )
    recompute_granularity: Literal["auto", "none", "full", "selective"] = option(
        "auto",
        "activation recomputation (Megatron's): 'full' keeps only each recomputed layer's input for backward, "
        "'selective' recomputes its core attention; 'auto': 'full' for a dense model trained on the CPU (where "
        "it costs no measurable step time), else 'none'",
    )
    recompute_method: Literal["uniform", "block"] = option(
        "uniform",
        "with 'full': 'uniform' recomputes every layer in groups of --recompute-num-layers, 'block' only "
        "the first --recompute-num-layers layers of each pipeline stage (less memory saved, less time spent)",
    )
    recompute_num_layers: int = option(1, "layers per recomputed group ('uniform') or recomputed layers ('block')")
    seed: int = option(1234, "random seed")
    bf16: bool = option(False, "train in bfloat16 (GPU); fp32 otherwise")
    save_train_details: bool = option(
        True,
        "keep each trained Sample's recomputed log-probs and advantages in OUTPUT_DIR/train_details.db "
        "(for inverted view)",
    )
    plugin_args: str | None = option(None, PLUGIN_ARGS_HELP)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: AdapterConfig = field(default_factory=AdapterConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        require(bool(self.hf_checkpoint), "--hf-checkpoint", self.hf_checkpoint, "a checkpoint directory")
        for name in ("num_rollout", "max_tokens_per_gpu", "recompute_num_layers"):
            require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        require(self.logprob_chunk_size >= 0, "--logprob-chunk-size", self.logprob_chunk_size, ">= 0")
        require(self.global_batch_size >= 0, "--global-batch-size", self.global_batch_size, ">= 0")

    def validate(self) -> None:
        """Cross-field checks that need the run's mode."""
        require(
            not self.debug_train_only or bool(self.load_debug_rollout_data),
            "--load-debug-rollout-data",
            self.load_debug_rollout_data,
            "a jsonl file of Samples with --debug-train-only",
        )
        # An adapter's product of a sequence-split input would need the gathers Megatron's linears do inside.
        require(
            not (self.lora.enabled and self.parallel.sequence_parallel),
            "--sequence-parallel",
            True,
            "off with --lora-rank",
        )
        self.parallel.validate()


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """Turn a training checkpoint into a Hugging Face model directory."""

    checkpoint: str = option("", "checkpoint directory (written by --save)", path=True)
    out: str = option("", "directory to write the Hugging Face model into", path=True)
    merge_lora: bool = option(
        False, "a LoRA checkpoint: fold the adapter into its base model (default: a PEFT adapter)"
    )

    def __post_init__(self) -> None:
        require(bool(self.checkpoint), "--checkpoint", self.checkpoint, "a checkpoint directory")
        require(bool(self.out), "--out", self.out, "an output directory")
