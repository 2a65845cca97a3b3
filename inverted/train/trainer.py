"""The learner on one rank: Megatron policy (+ frozen reference, teacher), RL loss, optimizer, checkpoints.

``Trainer.train(samples)`` is one rollout's worth of learning, read top to bottom:

1. ``check_samples``: every Sample is trainable by this model, before anything is computed (each
   Sample's own invariants were checked once, where it entered: the buffer, or the reader of
   ``--load-debug-rollout-data``).
2. The batch is cut into optimizer steps of ``--global-batch-size`` samples; in each step the
   samples are dealt to data-parallel ranks by length and packed into micro-batches of at most
   ``--max-tokens-per-gpu`` tokens.
3. A no-grad pass computes what the update needs from the *unchanged* policy: old log-probs (only
   when there is more than one optimizer step or distillation needs them; with one,
   ``logp.detach()`` is exactly the old policy) and the reference log-probs for KL.
4. Advantages for the whole batch, identical on every rank; under on-policy distillation (``--distill``)
   each token's loses the reverse KL to a teacher (``losses.distillation_penalty``). Each token's
   weight version says how far behind the policy it was sampled (its staleness, reported); with
   ``--mask-offpolicy-in-partial-rollout`` the tokens a sample got from weights older than its
   newest are left out of the loss. TIS (``--use-tis``) reweights every token by its own sampling
   policy's log-prob, so mixed versions are corrected token by token. A MoE policy with routing
   replay (``train/routing_replay.py``) routes these passes by the rollout's experts (R3), or
   records its routing in the old log-probs' pass for the steps to replay (R2).
5. Per optimizer step: forward and backward of the micro-batches through Megatron's schedule (1F1B
   across pipeline stages) with the step's global token weights, one gradient all-reduce (a sum:
   the weights already normalise), clip, step. The log-probs come from the final hidden states
   through the output layer chunk by chunk (``train/logprobs.py``: no ``[tokens x vocab]`` tensor
   is kept; ``--logprob-chunk-size``), or from the whole logits where a loss plug-in reads them;
   ``--recompute-granularity`` trades the layers' kept activations for a second forward in
   backward. The loss runs on the model's device: each rollout's
   per-token tensors go to the model's device once, and each micro-batch hands its statistics
   back through the schedule (Megatron's loss-reporting dict) as device tensors, reduced once at
   the end of the rollout, so no micro-batch waits on a device-to-host copy. With
   ``--moe-aux-loss-coeff`` Megatron's routers add their load-balancing loss, reported as
   ``train/moe_aux_loss``.

Every rank sees the same list of Samples and takes its data-parallel share itself, so nothing but
gradients, metric sums and (between pipeline stages) activations and the last stage's results
crosses ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from inverted.config import plugin_flags
from inverted.errors import ModelError, SampleError
from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors
from inverted.peft_adapter import lora_config, read_adapter
from inverted.plugins import LossPlugins
from inverted.train import details, lora, losses
from inverted.train.config import TrainConfig
from inverted.train.convert import check_compatible, gather_hf_weights, iter_hf_weights, load_hf_weights, over_pipeline
from inverted.train.logprobs import (
    Head,
    fused_logprobs_and_entropy,
    head_inputs,
    keep_mask,
    output_hidden_states,
    token_logprobs_and_entropy,
)
from inverted.train.model import Parallelism, Recompute, build_model, use_transformer_engine
from inverted.train.optimizer import build_optimizer
from inverted.train.packing import KeptSets, MicroBatch, balance, pack
from inverted.train.parallel import sequence_share
from inverted.train.routing_replay import RoutingReplay
from inverted.train.weight_sync import SyncReport, WeightSync
from inverted.types import Sample, version_number

logger = logging.getLogger(__name__)

TRAINABLE = {Sample.Status.COMPLETED, Sample.Status.TRUNCATED}


def sample_name(position: int, sample: Sample) -> str:
    """How an error names a Sample of a batch."""
    return f"sample {position} (index {sample.index}, group {sample.group_index})"


def check_samples(samples: list[Sample], spec: ModelSpec) -> None:
    """Raise ``SampleError`` naming the first sample that this model must not be trained on: one not
    finished, without a reward, or whose tokens the model cannot hold (``Sample.validate``, the
    Sample's own invariants, ran where it entered)."""
    if not samples:
        raise SampleError("no samples to train on")
    for position, sample in enumerate(samples):
        where = sample_name(position, sample)
        if sample.status not in TRAINABLE:
            raise SampleError(f"{where}: status {sample.status.value!r} is not trainable (completed or truncated)")
        if sample.reward is None:
            raise SampleError(f"{where}: reward is missing")
        if sample.prompt_length < 1:
            raise SampleError(f"{where}: needs at least one prompt token")
        if sample.tokens and max(sample.tokens) >= spec.vocab_size:
            raise SampleError(f"{where}: token id {max(sample.tokens)} is outside the vocabulary ({spec.vocab_size})")
        if len(sample.tokens) > spec.max_position_embeddings:
            raise SampleError(
                f"{where}: {len(sample.tokens)} tokens exceed the model's {spec.max_position_embeddings} positions"
            )
        _check_kept_sets(sample, spec, where)


def _check_kept_sets(sample: Sample, spec: ModelSpec, where: str) -> None:
    """A recorded kept set holds vocabulary ids and its own token (else its log-prob would be -inf)."""
    if sample.rollout_top_p_token_ids is None:
        return
    ids = np.asarray(sample.rollout_top_p_token_ids, dtype=np.int64)
    lengths: np.ndarray = np.diff(np.asarray(sample.rollout_top_p_token_offsets, dtype=np.int64))
    if len(ids) and ids.max() >= spec.vocab_size:
        raise SampleError(
            f"{where}: rollout_top_p_token_ids holds {ids.max()}, outside the vocabulary ({spec.vocab_size})"
        )
    row = np.repeat(np.arange(len(lengths)), lengths)
    found = np.bincount(row[ids == np.asarray(sample.response_tokens)[row]], minlength=len(lengths))
    missing = np.flatnonzero((lengths > 0) & (found == 0))
    if len(missing):
        raise SampleError(
            f"{where}: response token {missing[0]} ({sample.response_tokens[missing[0]]}) is not in "
            "its kept set (rollout_top_p_token_ids)"
        )


@dataclass(slots=True)
class RankBatch:
    """This rank's samples of one optimizer step, packed, with their per-token tensors."""

    micro_batches: list[MicroBatch]
    indices: list[int]
    step_samples: range  # every sample of the optimizer step, on all ranks


@dataclass(slots=True)
class PerToken:
    """The rollout's per-response-token tensors, by sample index (``old`` and ``ref`` may be empty)."""

    mask: dict[int, torch.Tensor]
    advantage: dict[int, torch.Tensor]
    rollout_logp: dict[int, torch.Tensor]
    old_logp: dict[int, torch.Tensor]
    ref_logp: dict[int, torch.Tensor]
    staleness: dict[int, torch.Tensor]  # policy version minus the token's sampling version
    weight: dict[int, torch.Tensor] = field(default_factory=dict)  # set per optimizer step
    step_samples: int = 0  # samples in the optimizer step (all ranks), set per step
    step_tokens: int = 0  # their trained tokens, set per step (slime's per-token loss divides by them)
    loss_scale: float = 1.0  # what the loss is multiplied by for backward (see ``_scale_aux_loss``)
    recorded: dict[int, torch.Tensor] | None = None  # the trainer's log-probs, kept for train_details.db

    def take(self, name: str, indices: list[int]) -> torch.Tensor:
        """One micro-batch's values of ``name``, concatenated in packing order."""
        return torch.cat([getattr(self, name)[i] for i in indices])

    def to(self, device: torch.device) -> "PerToken":
        """The same tensors on ``device``: moved once per rollout, not once per micro-batch."""

        def move(values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
            return {i: t.to(device, non_blocking=True) for i, t in values.items()}

        return PerToken(
            move(self.mask),
            move(self.advantage),
            move(self.rollout_logp),
            move(self.old_logp),
            move(self.ref_logp),
            move(self.staleness),
            recorded=self.recorded,
        )


# What each micro-batch's loss reports (summed over the rollout; token statistics divided by the
# loss tokens in the end), and the extremes (maxima; a minimum travels negated).
LOSS_PARTS = ("loss", "pg_loss", "kl_loss", "entropy_loss")
TOKEN_STATS = ("clipfrac", "ratio_mean", "tis_mean", "kl", "entropy", "token_staleness")
# sums over the tokens of Samples with rollout log-probs (the mismatch metrics), and those tokens
COUNTS = (
    "tokens",
    "fresh_logprob_abs_diff",
    "fresh_tokens",
    "train_rollout_logprob_abs_diff",
    "recorded_tokens",
    "rollout_ratio_outside",
    "kept_tokens",
    "kept_set_size",
    "unmasked_logprob_abs_diff",
    "unmasked_ratio_outside",
)
RATIO_BAND = 0.1  # the mismatch metric's band: a token's trainer/rollout ratio outside [0.9, 1.1] counts
MAXIMA = ("ratio_max", "neg_ratio_min", "token_staleness_max", "fresh_logprob_abs_diff_max")


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.cfg = cfg
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.spec = ModelSpec.from_checkpoint(cfg.hf_checkpoint)
        if not self.spec.is_moe and (cfg.moe.routing_replay or cfg.moe.moe_aux_loss_coeff):
            raise ModelError(
                f"{cfg.hf_checkpoint} is a dense model: --use-rollout-routing-replay, --use-routing-replay "
                "and --moe-aux-loss-coeff are for Mixture-of-Experts models"
            )
        if self.spec.is_moe and cfg.lora.enabled:
            raise ModelError(
                f"{cfg.hf_checkpoint} is a Mixture-of-Experts model: --lora-rank adapts dense models "
                "only (its experts would need adapters of their own)"
            )
        layout = cfg.parallel
        check_compatible(
            self.spec,
            layout.tensor_model_parallel_size,
            layout.pipeline_model_parallel_size,
            layout.expert_model_parallel_size,
            layout.sequence_parallel,
        )
        self.parallel = Parallelism(
            layout.tensor_model_parallel_size,
            layout.pipeline_model_parallel_size,
            layout.context_parallel_size,
            layout.expert_model_parallel_size,
            layout.sequence_parallel and layout.tensor_model_parallel_size > 1,
        )
        # Under sequence parallelism each packed row splits evenly between the tensor-parallel ranks.
        self.pad_to = self.parallel.tensor if self.parallel.sequence else 1
        self.dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        # Our PyTorch attention (not TE's) takes segments whose responses share their prompt.
        self.te = use_transformer_engine() and not cfg.lora.enabled  # see build_model
        self.packed_attention = not self.te
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        hf_weights = checkpoint_tensors(cfg.hf_checkpoint)
        recompute = Recompute.of(cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers, self.spec)
        model = build_model(
            self.spec,
            self.parallel,
            self.dtype,
            self.te,
            cfg.moe,
            routing_replay=cfg.moe.routing_replay,
            recompute=recompute,
        )
        load_hf_weights(model, self.spec, hf_weights)
        self.replay = RoutingReplay(model, self.spec, self.parallel.sequence) if cfg.moe.routing_replay else None
        a = cfg.lora
        self.lora = lora_config(a.lora_rank, a.lora_alpha, a.lora_dropout, a.target_modules, a.lora_adapter_path)
        if self.lora is not None:
            lora.attach(model, self.spec, self.lora, cfg.seed)
            if a.lora_adapter_path:
                lora.load_adapter(model, self.spec, self.lora, read_adapter(a.lora_adapter_path)[1])
        self.distributed_optimizer = torch.cuda.is_available() and cfg.optim.use_distributed_optimizer
        self.model = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=self.distributed_optimizer,
            ),
            model,
        )
        self.optimizer = build_optimizer(cfg.optim, self.model, bf16=cfg.bf16)
        # With LoRA the reference is the base model: the policy with its adapters off, no second copy.
        self.reference = self._frozen(hf_weights) if cfg.loss.needs_reference and self.lora is None else None
        self.step = 0  # the step it trains next: the steps trained (or skipped) so far
        self.optimizer_steps = 0
        self.plugins = LossPlugins.load(cfg.loss, plugin_flags(cfg))  # the loss hooks (plugins.LossPlugins)
        # Log-probs straight from the final hidden states, chunk by chunk (train/logprobs.py), unless a
        # loss plug-in reads the logits themselves.
        self.fused_head = cfg.logprob_chunk_size > 0 and self.plugins.loss is None
        # on-policy distillation with the teacher in the trainer (--distill teacher)
        self.teacher = (  # a checkpoint is given exactly when --distill teacher (LossConfig.validate)
            self._frozen(checkpoint_tensors(cfg.loss.distill_teacher)) if cfg.loss.distill_teacher else None
        )
        self.details: details.DetailsWriter | None = None  # opened by rank 0 at its first write

    def _frozen(self, hf_weights: dict[str, torch.Tensor]):
        """A frozen model of the policy's architecture (the KL reference: the policy's starting weights;
        the distillation teacher): no gradients, no optimizer state, eval mode."""
        frozen = build_model(self.spec, self.parallel, self.dtype, self.te, self.cfg.moe)  # routes on its own
        load_hf_weights(frozen, self.spec, hf_weights)
        frozen.requires_grad_(False).eval()
        return frozen

    # -- forward -----------------------------------------------------------------------------

    def _schedule(
        self,
        model,
        mbs: list[MicroBatch],
        on_output: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]],
        forward_only: bool,
        routing: str | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """Run ``mbs`` through Megatron's schedule: 1F1B across pipeline stages, a plain loop without.

        Every stage reads the same micro-batches (each needs the packing to place its attention);
        the first embeds the tokens, the others take the previous stage's activations. On the last
        stage ``on_output(mb, output)`` turns a micro-batch's output (its final hidden states ``[T, H]``
        with the fused head, else its logits ``[T, V / tp]``; see ``_logprobs``) into its loss and a
        dict of statistics, and the schedule runs the backward passes unless ``forward_only``.
        ``routing`` (the policy with routing replay): "record" or "replay" each micro-batch's routing.
        Returns the statistics of every micro-batch (on the last stage; elsewhere none).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not mbs:
            return []
        device = self.device

        def forward_step(batches, model):
            mb = next(batches)
            routed = self.replay.forward(mb, routing) if routing and self.replay else contextlib.nullcontext()
            head = output_hidden_states(model) if self.fused_head else contextlib.nullcontext()
            with routed, head:
                output = self.forward(model, mb)
            tokens = torch.tensor(sum(mb.response_lengths), dtype=torch.int, device=device)

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
                loss, stats = on_output(mb, output[0])
                return loss, tokens, stats  # Megatron collects each ``stats`` and returns them all

            return output, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=model,
            num_microbatches=len(mbs),
            seq_length=max(len(mb.tokens_T) for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def forward(self, model, mb: MicroBatch) -> torch.Tensor:
        """One stage's forward of a packed micro-batch: logits ``[1, T, V / tp]`` on the last stage, else
        the activations for the next."""
        device = self.device
        return model(
            input_ids=mb.tokens_T[None].to(device),
            position_ids=mb.positions_T[None].to(device),
            attention_mask=None,
            packed_seq_params=self.seq_params(mb, device),
            padding_mask=self._padding_mask(mb),
        )

    def _padding_mask(self, mb: MicroBatch) -> torch.Tensor | None:
        """True at ``mb``'s padding (``[1, T]``), for the routers: they send it to no expert and leave it out
        of the load-balancing loss. None without padding or experts."""
        from megatron.core import parallel_state

        if not (mb.padding and self.spec.is_moe):
            return None
        mask = torch.zeros(1, len(mb.tokens_T), dtype=torch.bool)
        mask[0, -mb.padding :] = True
        if not parallel_state.is_pipeline_first_stage():  # the first stage's embedding splits it with the sequence
            mask = sequence_share(mask, dim=1)
        return mask.to(self.device)

    def seq_params(self, mb: MicroBatch, device: torch.device | str):
        """Megatron's packed-sequence parameters of ``mb``: its segments, and RoPE where our attention applies it."""
        from inverted.train.attention import packed_seq_params

        return packed_seq_params(mb, device, self.spec if self.packed_attention else None)

    def _logprobs(self, model, mb: MicroBatch, output: torch.Tensor, with_entropy: bool) -> Head:
        """Response-token log-probs (and entropies) of one packed micro-batch, fp32, ``[R]``, from ``model``'s
        output: its final hidden states through the fused head, or its logits; a token with a kept set
        (``mb.kept``) over that set."""
        positions, targets = mb.response_positions().to(output.device), mb.response_targets().to(output.device)
        temperature = self.cfg.loss.rollout_temperature
        if not self.fused_head:
            return token_logprobs_and_entropy(
                output[positions],
                targets,
                temperature,
                with_entropy,
                keep_mask(mb.kept, len(positions), output.shape[-1], output.device),
            )
        hidden, weight, low_rank = head_inputs(model, output[positions])
        head = fused_logprobs_and_entropy(
            hidden, weight, targets, temperature, self.cfg.logprob_chunk_size, mb.kept, low_rank
        )
        return head if with_entropy else head._replace(entropy=None)

    @torch.no_grad()
    def _no_grad_logprobs(self, model, mbs: list[MicroBatch], routing: str | None = None) -> dict[int, torch.Tensor]:
        """Each sample's response log-probs under ``model``, by sample index, on every pipeline stage."""
        model.eval()
        out: dict[int, torch.Tensor] = {}

        def keep(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp = self._logprobs(model, mb, output, with_entropy=False).logprobs
            out.update(zip(mb.indices, logp.split(mb.response_lengths)))
            return logp.new_zeros(()), {}

        self._schedule(model, mbs, keep, forward_only=True, routing=routing)
        return self._from_last_stage(out)

    def _reference_logprobs(self, mbs: list[MicroBatch]) -> dict[int, torch.Tensor]:
        if self.reference is not None:
            return self._no_grad_logprobs(self.reference, mbs)
        with lora.disabled(self.model.module):
            return self._no_grad_logprobs(self.model, mbs)

    def _from_last_stage(self, value):
        """``value`` as the last pipeline stage holds it, on every stage (losses and log-probs are computed there)."""
        from megatron.core import parallel_state

        if self.parallel.pipeline == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return box[0]

    # -- one rollout ---------------------------------------------------------------------------

    def _plan(self, samples: list[Sample]) -> list[RankBatch]:
        """This rank's packed share of each optimizer step."""
        size = self.cfg.global_batch_size or len(samples)
        if len(samples) % size:
            raise SampleError(f"{len(samples)} samples do not split into optimizer steps of --global-batch-size {size}")
        plan = []
        for start in range(0, len(samples), size):
            step = list(range(start, start + size))
            mine = [step[i] for i in balance([len(samples[i].tokens) for i in step], self.dp_size)[self.dp_rank]]
            mbs = pack(
                [samples[i].tokens for i in mine],
                [samples[i].response_length for i in mine],
                mine,
                self.cfg.max_tokens_per_gpu,
                share_prefixes=self.packed_attention,
                multiple_of=self.pad_to,
                # R3 runs a shared prompt once by one record of its experts: only where every record agrees
                prompt_keys=[self.replay.prompt_key(i) for i in mine] if self.replay and self.replay.samples else None,
            )
            for mb in mbs:  # the sampling masks the log-prob head replays
                mb.kept = KeptSets.of([samples[i] for i in mb.indices])
            plan.append(RankBatch(mbs, mine, range(start, start + size)))
        return plan

    def _gather_over_dp(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        from megatron.core import parallel_state

        if self.dp_size == 1:
            return values
        parts: list[dict[int, torch.Tensor]] = [{} for _ in range(self.dp_size)]
        torch.distributed.all_gather_object(parts, values, group=parallel_state.get_data_parallel_group())
        return {k: v for part in parts for k, v in part.items()}

    def _all_samples(self, values: dict[int, torch.Tensor], count: int) -> list[torch.Tensor]:
        """Per-sample values this rank holds, gathered from every data-parallel rank, in sample order."""
        gathered = self._gather_over_dp({i: v.cpu() for i, v in values.items()})
        return [gathered[i] for i in range(count)]

    def train(self, samples: list[Sample]) -> dict[str, float]:
        """Learn from one rollout's samples; returns this rollout's metrics (identical on every rank)."""
        from megatron.core.distributed import finalize_model_grads

        cfg, loss = self.cfg, self.cfg.loss
        started = time.perf_counter()
        check_samples(samples, self.spec)
        if self.replay is not None and cfg.moe.use_rollout_routing_replay:
            self.replay.rollout(samples)  # R3's records, before the plan: they decide which prompts are shared
        plan = self._plan(samples)
        all_mbs = [mb for step in plan for mb in step.micro_batches]
        versions = [torch.tensor([version_number(v) for v in s.weight_versions], dtype=torch.int64) for s in samples]
        masks = [torch.tensor(s.loss_mask, dtype=torch.float32) * (not s.remove_sample) for s in samples]
        if loss.mask_offpolicy_in_partial_rollout:
            masks = [m * (v == v.max()) if len(v) else m for m, v in zip(masks, versions)]
        rewards, teacher_logp = self._rewards(samples)
        distill = loss.distill != "none"
        # Samples whose sampler recorded no log-probs: the trainer's old log-probs stand in for them, and
        # what compares the two (TIS, the mismatch metric, KL as reward) leaves them out.
        unrecorded = [i for i, s in enumerate(samples) if s.rollout_log_probs is None]

        # R2 records the old policy's routing here; R3 routes by the rollout's (routing_replay.py).
        # One optimizer step trains on the live log-probs, unless distillation needs them beforehand.
        old_logp = (
            self._no_grad_logprobs(self.model, all_mbs, "record" if cfg.moe.use_routing_replay else "replay")
            if len(plan) > 1 or distill
            else {}
        )
        ref_logp = self._reference_logprobs(all_mbs) if loss.needs_reference else {}
        kl_reward = None
        if loss.kl_coef:
            # KL as reward uses the policy that sampled (the rollout log-probs) against the reference.
            kl_reward = self._all_samples(
                {
                    i: (
                        torch.tensor(samples[i].rollout_log_probs) - ref_logp[i].cpu()
                        if samples[i].rollout_log_probs is not None
                        else torch.zeros_like(ref_logp[i].cpu())
                    )
                    for i in ref_logp
                },
                len(samples),
            )
        advantages = losses.compute_advantages(
            loss.advantage_estimator,
            rewards,
            [s.group_index for s in samples],
            masks,
            kl_reward,
            loss.kl_coef,
            loss.gamma,
            std_normalize=not loss.disable_grpo_std_normalization,
            baseline=self.plugins.reward_post_process is None and not loss.raw_rewards,
        )
        reverse_kl = None
        if distill:
            if self.teacher is not None:
                teacher_logp = self._all_samples(self._no_grad_logprobs(self.teacher, all_mbs), len(samples))
            assert teacher_logp is not None  # else --distill samples: the Samples' own (_rewards)
            advantages, reverse_kl = losses.distillation_penalty(
                advantages, self._all_samples(old_logp, len(samples)), teacher_logp, loss.distill_kl_coef
            )

        tokens = PerToken(
            mask=dict(enumerate(masks)),
            advantage=dict(enumerate(advantages)),
            old_logp=old_logp,
            ref_logp=ref_logp,
            staleness={i: (self.step - v).float() for i, v in enumerate(versions)},
            rollout_logp={
                i: torch.tensor(s.rollout_log_probs, dtype=torch.float32)
                if s.rollout_log_probs is not None
                else torch.full((s.response_length,), torch.nan)
                for i, s in enumerate(samples)
            },
            recorded={} if cfg.save_train_details else None,
        ).to(self.device)
        reported: list[dict[str, torch.Tensor]] = []
        grad_norms = []
        self.model.train()
        for step in plan:
            span = step.step_samples
            tokens.weight = {
                i: w.to(self.device)
                for i, w in zip(span, losses.token_weights(loss.loss_aggregation, masks[span.start : span.stop]))
            }
            tokens.step_samples = len(span)
            tokens.step_tokens = int(sum(masks[i].sum() for i in span))
            tokens.loss_scale = self._scale_aux_loss(step.micro_batches)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            reported += self._schedule(
                self.model,
                step.micro_batches,
                functools.partial(self._loss, tokens=tokens),
                forward_only=False,
                routing="replay",
            )
            # Megatron's own finish: the data-parallel sum, the tensor-parallel sums of grads that each
            # TP rank computes only in part (q/k norms see only that rank's heads), and under PP the sum
            # of the tied embedding's two copies (first and last stage), which keeps them equal.
            finalize_model_grads([self.model])
            _, grad_norm, _ = self.optimizer.step()
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            self.optimizer_steps += 1
        if tokens.recorded is not None:
            self._save_details(samples, self._gather_over_dp(self._from_last_stage(tokens.recorded)), advantages, masks)
        self.step += 1
        if self.replay is not None:
            self.replay.reset()
        metrics = self._reduce_metrics(reported, steps=len(plan))
        if cfg.moe.moe_aux_loss_coeff:
            metrics["train/moe_aux_loss"] = self._aux_loss_metric(sum(len(step.micro_batches) for step in plan))
        metrics.update(
            {
                "train/grad_norm": sum(grad_norms) / len(grad_norms),
                "train/optimizer_steps": float(len(plan)),
                "train/reward_mean": float(rewards.mean()),
                "train/lr": cfg.optim.lr,
                "train/offpolicy_masked_tokens": float(
                    sum(s.loss_mask.count(1) for s in samples) - sum(m.sum() for m in masks)
                ),
                "train/advantage_mean": float(torch.cat(advantages).mean()) if advantages else 0.0,
                "train/samples_without_rollout_logprobs": float(len(unrecorded)),
                **({"train/opd_reverse_kl": losses.masked_mean(reverse_kl, masks)} if reverse_kl is not None else {}),
                "perf/train_tokens_per_s": sum(len(s.tokens) for s in samples) / (time.perf_counter() - started),
                "perf/train_step_s": time.perf_counter() - started,
            }
        )
        return metrics

    def _rewards(self, samples: list[Sample]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The rewards trained on, and under on-policy distillation from the Samples (``--distill
        samples``) the teacher's log-prob of each response token (``Sample.teacher_log_probs``, which
        a reward post-process may set). With a post-process the rewards are its own, read by it from
        the raw ones (which need not be numbers: distillation's are the teacher's answer)."""
        if self.plugins.reward_post_process is None:
            rewards = [s.scalar_reward(self.cfg.loss.reward_key) for s in samples]
        else:
            rewards = self.plugins.reward_post_process(samples)
        rewards_N = torch.tensor([float(r) for r in rewards], dtype=torch.float32)
        if self.cfg.loss.distill != "samples":
            return rewards_N, None
        teacher = []
        for sample in samples:
            if sample.teacher_log_probs is None:
                raise SampleError(
                    f"sample {sample.index} of group {sample.group_index}: --distill samples needs the "
                    "teacher's log-probs (sample.teacher_log_probs), which --custom-reward-post-process-path "
                    "sets (slime.rollout.on_policy_distillation.post_process_rewards)"
                )
            teacher.append(torch.as_tensor(sample.teacher_log_probs, dtype=torch.float32))
        return rewards_N, teacher

    def close(self) -> None:
        """Release what the trainer holds open outside the process group (``train_details.db``)."""
        if self.details is not None:
            self.details.close()
            self.details = None

    def _save_details(
        self,
        samples: list[Sample],
        log_probs: dict[int, torch.Tensor],
        advantages: list[torch.Tensor],
        masks: list[torch.Tensor],
    ) -> None:
        """This rollout's rows of ``train_details.db`` (rank 0 writes them all)."""
        if torch.distributed.get_rank() != 0:
            return
        if self.details is None:
            self.details = details.DetailsWriter(self.cfg.output_dir)
        rows = []
        for i, sample in enumerate(samples):
            logp, adv, mask = log_probs[i].numpy(), advantages[i].float().cpu().numpy(), masks[i].numpy()
            rollout = None if sample.rollout_log_probs is None else np.asarray(sample.rollout_log_probs, np.float32)
            mismatch, advantage = details.summarise(logp, rollout, adv, mask)
            rows.append(
                details.Detail(
                    -1 if sample.group_index is None else sample.group_index,
                    -1 if sample.index is None else sample.index,
                    int(sample.metadata.get("branch", 0)),
                    self.step,
                    mismatch,
                    advantage,
                    logp,
                    adv,
                )
            )
        self.details.write(rows)

    def _loss(
        self, mb: MicroBatch, output: torch.Tensor, tokens: PerToken
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One micro-batch's loss from the policy's output, and its statistics (device tensors, see ``LOSS_PARTS``)."""
        cfg, plugins = self.cfg.loss, self.plugins
        mask, weight = tokens.take("mask", mb.indices), tokens.take("weight", mb.indices)
        adv, rollout = tokens.take("advantage", mb.indices), tokens.take("rollout_logp", mb.indices)
        staleness = tokens.take("staleness", mb.indices)
        seq_ids = torch.repeat_interleave(
            torch.arange(len(mb.indices), device=mask.device), torch.tensor(mb.response_lengths, device=mask.device)
        )

        logp, entropy, unmasked = self._logprobs(self.model, mb, output, with_entropy=True)
        assert entropy is not None  # asked for
        old = tokens.take("old_logp", mb.indices) if tokens.old_logp else logp.detach()
        recorded = ~rollout.isnan()  # tokens whose sampler recorded a log-prob; the old one stands in elsewhere
        rollout = torch.where(recorded, rollout, old.detach())
        if tokens.recorded is not None:
            tokens.recorded.update(zip(mb.indices, old.detach().float().cpu().split(mb.response_lengths)))
        ref = tokens.take("ref_logp", mb.indices) if tokens.ref_logp else None
        if plugins.loss is not None:
            named = {"loss_masks": mask, "advantages": adv, "log_probs": old, "rollout_log_probs": rollout}
            loss, custom = plugins.loss(mb, output, named | ({"ref_log_probs": ref} if ref is not None else {}), weight)
            custom = {f"custom/{name}": value for name, value in custom.items()}
        pg, info = losses.policy_loss(
            cfg.advantage_estimator,
            logp,
            old,
            adv,
            mask,
            seq_ids,
            len(mb.indices),
            cfg.eps_clip,
            cfg.eps_clip_high or cfg.eps_clip,
            cfg.eps_clip_c,
        )
        if plugins.tis is not None:
            pg, weight, tis = plugins.tis(mb, pg, old, rollout, mask, weight, cfg.loss_aggregation)
            tis = tis if tis is not None else torch.ones_like(pg)
        else:
            tis = (
                losses.tis_weights(old, rollout, cfg.tis_clip_low, cfg.tis_clip) if cfg.use_tis else torch.ones_like(pg)
            )
            pg = pg * tis
        kl = losses.kl_penalty(logp, ref, cfg.kl_loss_type) if ref is not None else torch.zeros_like(pg)
        per_token = cfg.per_token_loss
        pg_term = (
            plugins.reducer(mb, pg, mask, tokens.step_tokens if per_token else tokens.step_samples, per_token)
            if plugins.reducer is not None
            else (weight * pg).sum()
        )
        if cfg.loss_type == "sft_loss":  # slime's: -sum_of_sample_mean(log_probs), i.e. our aggregation of the NLL
            loss = -(weight * logp).sum()
        elif plugins.loss is None:
            loss = pg_term - cfg.entropy_coef * (weight * entropy).sum()
            if cfg.use_kl_loss:
                loss = loss + cfg.kl_loss_coef * (weight * kl).sum()

        with torch.no_grad():
            on = mask.bool()
            # The same gap on the tokens sampled by the very weights being trained: ~0 when every
            # token's recorded version is the one that sampled it.
            fresh = on & (staleness == 0) & recorded
            gap = (old - rollout).abs()
            ratio = info["ratio"]
            compared = on & recorded
            outside = ((old - rollout).exp() - 1).abs() > RATIO_BAND
            # tokens sampled from a cut distribution with its kept set recorded: how far off a trainer that
            # ignored the set would be (its whole-vocabulary log-prob against the recorded one)
            kept = (
                mb.kept.offsets.diff().to(on.device)
                if mb.kept is not None
                else torch.zeros_like(mask, dtype=torch.long)
            )
            masked = compared & (kept > 0)
            whole = unmasked if unmasked is not None else logp.detach()
            stats = {
                "loss": loss.detach(),
                "pg_loss": pg_term.detach(),
                "kl_loss": (weight * kl).sum(),
                "entropy_loss": (weight * entropy).sum(),
                "tokens": on.sum(),
                "fresh_logprob_abs_diff": gap[fresh].sum(),
                "fresh_tokens": fresh.sum(),
                "train_rollout_logprob_abs_diff": gap[compared].sum(),
                "recorded_tokens": compared.sum(),
                "rollout_ratio_outside": outside[compared].sum(),
                "kept_tokens": masked.sum(),
                "kept_set_size": kept[masked].sum(),
                "unmasked_logprob_abs_diff": (whole - rollout).abs()[masked].sum(),
                "unmasked_ratio_outside": (((whole - rollout).exp() - 1).abs() > RATIO_BAND)[masked].sum(),
                "ratio_max": torch.where(on, ratio, -torch.inf).max(),
                "neg_ratio_min": -torch.where(on, ratio, torch.inf).min(),
                "token_staleness_max": torch.where(on, staleness, 0.0).max(),
                # the largest gap between the trainer and the server that sampled with the same weights:
                # at fp32, the two engines' numerics alone (real SGLang within 1e-5 of the trainer)
                "fresh_logprob_abs_diff_max": torch.where(fresh, gap, 0.0).max(),
            }
            for name, value in (
                ("clipfrac", info["clipped"]),
                ("ratio_mean", ratio),
                ("tis_mean", tis),
                ("kl", kl),
                ("entropy", entropy),
                ("token_staleness", staleness),
            ):
                stats[name] = value[on].sum()
            if plugins.loss is not None:
                stats |= custom
        return loss * tokens.loss_scale, stats

    def _scale_aux_loss(self, mbs: list[MicroBatch]) -> float:
        """The load-balancing loss's share of the gradient, for one optimizer step; returns the factor
        the step's loss is multiplied by.

        With per-token losses Megatron's routers weigh each micro-batch's aux loss by its tokens, and
        expect the gradients to be divided by the step's tokens afterwards; ours arrive normalised.
        So the backward scale (``grad_scale_func``, which Megatron applies to the loss and hands to
        the routers) is 1 / the step's tokens on all ranks, and the loss is multiplied back: the aux
        loss is then a token mean over the step, the policy loss unchanged. Padding is no token
        (the routers skip it).
        """
        from megatron.core import parallel_state

        if not self.cfg.moe.moe_aux_loss_coeff:
            return 1.0
        tokens = torch.tensor([float(sum(len(mb.tokens_T) - mb.padding for mb in mbs))], dtype=torch.float64)
        if self.dp_size > 1:
            torch.distributed.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
        step_tokens = float(tokens)
        self.model.config.grad_scale_func = lambda loss: loss / step_tokens
        return step_tokens

    def _aux_loss_metric(self, micro_batches: int) -> float:
        """The load-balancing loss (without its coefficient), averaged over layers, micro-batches and ranks."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracked = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")  # none if no forward ran here
        local = tracked["values"].sum() if tracked is not None else 0.0
        total = torch.tensor([float(local)], dtype=torch.float64) / (self.spec.num_layers * max(micro_batches, 1))
        if self.parallel.pipeline > 1:  # each stage holds its own layers' values
            torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        if self.parallel.sequence:  # and each tensor-parallel rank its share of the sequence's
            torch.distributed.all_reduce(total, group=parallel_state.get_tensor_model_parallel_group())
        if self.dp_size > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
            total /= self.dp_size
        clear_aux_losses_tracker()
        return float(total)

    def _reduce_metrics(self, reported: list[dict[str, torch.Tensor]], steps: int) -> dict[str, float]:
        """Global metrics from every micro-batch's statistics, read off the device once: loss parts
        averaged over optimizer steps, token statistics over loss tokens."""
        from megatron.core import parallel_state

        def column(name: str, reduce: Callable[[torch.Tensor], torch.Tensor], empty: float) -> torch.Tensor:
            values = [r[name].double() for r in reported]
            return (
                reduce(torch.stack(values)) if values else torch.tensor(empty, dtype=torch.float64, device=self.device)
            )

        # A custom loss's own metrics are aggregated like the loss (sum_of_sample_mean): summed, per step.
        extra = tuple(sorted(set(reported[0]) - set(LOSS_PARTS + TOKEN_STATS + COUNTS + MAXIMA))) if reported else ()
        summed = LOSS_PARTS + TOKEN_STATS + COUNTS + extra
        sums = torch.stack([column(n, torch.sum, 0.0) for n in summed])
        high = torch.stack(
            [column(n, torch.max, -float("inf") if n.startswith(("ratio", "neg")) else 0.0) for n in MAXIMA]
        )
        if self.dp_size > 1:
            group = parallel_state.get_data_parallel_group()
            torch.distributed.all_reduce(sums, group=group)
            torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
        totals = dict(zip(summed, sums.tolist()))
        highs = dict(zip(MAXIMA, high.tolist()))
        tokens = max(totals["tokens"], 1.0)
        metrics = {f"train/{n}": totals[n] / steps for n in LOSS_PARTS + extra}
        metrics.update({f"train/{n}": totals[n] / tokens for n in TOKEN_STATS})
        metrics["train/ratio_max"], metrics["train/ratio_min"] = highs["ratio_max"], -highs["neg_ratio_min"]
        metrics["train/token_staleness_max"] = highs["token_staleness_max"]
        if totals["fresh_tokens"]:
            metrics["train/fresh_logprob_abs_diff"] = totals["fresh_logprob_abs_diff"] / totals["fresh_tokens"]
            metrics["train/fresh_logprob_abs_diff_max"] = highs["fresh_logprob_abs_diff_max"]
        if totals["recorded_tokens"]:  # absent where no trained Sample recorded its rollout log-probs
            metrics["train/train_rollout_logprob_abs_diff"] = (
                totals["train_rollout_logprob_abs_diff"] / totals["recorded_tokens"]
            )
            metrics["train/rollout_ratio_outside"] = totals["rollout_ratio_outside"] / totals["recorded_tokens"]
            metrics["train/kept_set_tokens"] = totals["kept_tokens"] / totals["recorded_tokens"]
        if totals["kept_tokens"]:  # sampled from a cut distribution, with the cut replayed
            metrics["train/kept_set_size_mean"] = totals["kept_set_size"] / totals["kept_tokens"]
            # what the same tokens' mismatch would be without the replay: the bias it removes
            metrics["train/unmasked_logprob_abs_diff"] = totals["unmasked_logprob_abs_diff"] / totals["kept_tokens"]
            metrics["train/unmasked_ratio_outside"] = totals["unmasked_ratio_outside"] / totals["kept_tokens"]
        metrics["train/loss_tokens"] = totals["tokens"]
        return self._from_last_stage(metrics)

    # -- weights and checkpoints -------------------------------------------------------------

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The current policy as full Hugging Face tensors (gathered over tensor parallelism); with
        LoRA, the base weights (the adapter is ``adapter_weights``)."""
        return gather_hf_weights(self.model.module, self.spec)

    def adapter_config(self) -> dict | None:
        """A LoRA run's PEFT adapter_config (what the servers load its adapter with); None without LoRA."""
        return self.lora.to_peft(self.cfg.hf_checkpoint) if self.lora is not None else None

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter as full tensors with PEFT's names, on the first pipeline stage (every rank iterates)."""
        local = lora.adapter_tensors(self.model.module)
        return local if self.parallel.pipeline == 1 else over_pipeline(local, self.device)

    def sync_weights(self, sync: WeightSync, version: str) -> SyncReport | None:
        """Push the current policy into the rollout servers; every rank calls this.

        Global rank 0 sends; the other ranks of its model replica take part in the TP gathers and
        the pipeline's sends (collectives) and return None. With expert parallelism every rank takes
        part: each stage of rank 0's replica gathers the experts it lacks from its expert-parallel
        group, whose other ranks belong to other replicas (which then gather their own, unused).
        Without it, other data-parallel replicas have nothing to do.
        """
        from megatron.core import parallel_state

        weights = self.adapter_weights() if self.lora is not None else iter_hf_weights(self.model.module, self.spec)
        if torch.distributed.get_rank() == 0:
            return asyncio.run(sync.update(weights, version))
        if parallel_state.get_data_parallel_rank() == 0 or self.parallel.expert > 1:
            for _ in weights:
                pass
        return None
