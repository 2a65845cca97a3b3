"""A learner the caller's own loop drives: forward_backward on datums, gradients kept until optim_step.

This is the trainer of jobs (``Trainer``: the Megatron policy, LoRA, its optimizer, its log-prob head,
its weight sync) with a different owner of the loop. A Tinker client sends datums, each a token
sequence, a target for every position and the loss's inputs; ``forward_backward`` packs them
(``packing.pack``: a group's datums share their common beginning as one prompt, each its own
targets at every position), runs
them through the same Megatron schedule as a job's step and adds their gradients to what earlier
calls left; ``optim_step`` takes one AdamW step with the caller's hyper-parameters and clears the
gradients. ``push`` sends the current weights (a LoRA model: its adapter, under its own name) into
the rollout servers by the job's weight sync.

One process holds any number of learners, each its own ``Trainer``; they share the process's
Megatron state (one rank, no model parallelism), and their calls are serialised by the caller.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from inverted.errors import SampleError
from inverted.peft_adapter import HEAD
from inverted.rollout.sglang_client import ServerKeys
from inverted.train import datum_losses
from inverted.train.config import AdapterConfig, TrainConfig
from inverted.train.optimizer import set_adam
from inverted.train.packing import MicroBatch, pack
from inverted.train.trainer import Trainer
from inverted.train.weight_sync import WeightSync, make_weight_sync


@dataclass(frozen=True, slots=True)
class AdamStep:
    """One step's hyper-parameters, as Tinker's ``AdamParams`` names them."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass(frozen=True, slots=True)
class LoraShape:
    """The adapter a client asks for (the SDK's ``LoraConfig``): its rank, and which of the attention,
    the MLP and the unembedding (the output layer) it adapts."""

    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @classmethod
    def of(cls, config: dict) -> LoraShape:
        """The shape of the SDK's ``lora_config`` (its defaults where a field is absent)."""
        flags = {k: bool(config.get(k, True)) for k in ("train_attn", "train_mlp", "train_unembed")}
        return cls(int(config["rank"]), config.get("seed"), **flags)

    def config(self) -> dict:
        """As the SDK's ``lora_config`` (the seed left out: a model made from a checkpoint has its weights)."""
        return {
            "rank": self.rank,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
        }

    def modules(self) -> list[str]:
        return (
            (["q_proj", "k_proj", "v_proj", "o_proj"] if self.train_attn else [])
            + (["gate_proj", "up_proj", "down_proj"] if self.train_mlp else [])
            + ([HEAD] if self.train_unembed else [])
        )


class Learner:
    def __init__(self, cfg: TrainConfig, lora: LoraShape | None) -> None:
        if lora is not None:
            if not lora.modules():
                raise SampleError(
                    "a LoRA model must adapt the attention, the MLP or the unembedding "
                    "(train_attn, train_mlp, train_unembed)"
                )
            cfg = dataclasses.replace(
                cfg,
                lora=dataclasses.replace(
                    cfg.lora, lora_rank=lora.rank, target_modules=lora.modules(), lora_adapter_path=None
                ),
                seed=cfg.seed if lora.seed is None else lora.seed,
            )
        else:
            cfg = dataclasses.replace(cfg, lora=AdapterConfig())
        self.trainer = Trainer(cfg)
        self._sync: WeightSync | None = None

    @property
    def spec(self):
        return self.trainer.spec

    @property
    def steps(self) -> int:
        """Optimizer steps taken (a loaded checkpoint's included)."""
        return self.trainer.optimizer_steps

    def _pack(self, data: list[tuple[np.ndarray, np.ndarray]]) -> list[MicroBatch]:
        """Each datum as a prompt and a response whose targets are the datum's own, at every position of it.

        Consecutive datums that begin alike (a group's samples: one observation, several actions) share
        that beginning as one prompt, run once; packed attention lets each attend to it and to itself
        only, so every logit is the one the datum alone would give. A datum shares nothing under
        Transformer Engine's attention (plain sequences), or when it begins unlike its neighbours:
        its prompt is then its first token."""
        inputs = [tokens.tolist() for tokens, _ in data]
        share = self.trainer.packed_attention
        prompts = shared_prefixes(inputs) if share else [1] * len(inputs)
        sequences = [[*tokens, 0] for tokens in inputs]  # the last slot's token is never read
        mbs = pack(
            sequences,
            [len(tokens) + 1 - p for tokens, p in zip(inputs, prompts)],
            list(range(len(data))),
            self.trainer.cfg.max_tokens_per_gpu,
            share_prefixes=share,
        )
        for mb in mbs:
            mb.targets = torch.cat([torch.as_tensor(data[i][1], dtype=torch.long) for i in mb.indices])
            # a datum's i-th target is read at its i-th position, the shared prompt's included
            mb.positions = torch.cat([positions[:-1] for positions in mb.sequence_positions()])
        return mbs

    def forward_backward(
        self,
        data: list[tuple[np.ndarray, np.ndarray]],
        loss: datum_losses.Loss,
        inputs: list[dict[str, torch.Tensor]],
        config: dict[str, float],
        forward_only: bool,
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Each datum's target log-probs (fp32) and the summed loss; gradients accumulate unless ``forward_only``."""
        trainer = self.trainer
        started = time.perf_counter()
        logps: dict[int, torch.Tensor] = {}
        device = trainer.device

        def on_output(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            logp = trainer._logprobs(trainer.model, mb, output, with_entropy=False).logprobs
            total = logp.new_zeros(())
            for i, value in zip(mb.indices, logp.split([len(data[i][0]) for i in mb.indices])):
                logps[i] = value.detach()
                total = total + loss(value, {k: v.to(device) for k, v in inputs[i].items()}, config)
            return total, {"loss": total.detach()}

        mbs = self._pack(data)
        if forward_only:
            trainer.model.eval()
            with torch.no_grad():
                reported = trainer._schedule(trainer.model, mbs, on_output, forward_only=True)
        else:
            trainer.model.train()
            reported = trainer._schedule(trainer.model, mbs, on_output, forward_only=False)
        total = float(sum(r["loss"].double() for r in reported)) if reported else 0.0
        tokens = sum(len(tokens) for tokens, _ in data)
        metrics = {
            "loss:sum": total,
            "num_tokens:sum": float(tokens),
            "tokens_per_s:mean": tokens / max(time.perf_counter() - started, 1e-9),
        }
        return [logps[i].float().cpu().numpy() for i in range(len(data))], metrics

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last, with ``step``'s hyper-parameters."""
        from megatron.core.distributed import finalize_model_grads

        trainer = self.trainer
        optimizer = trainer.optimizer
        set_adam(
            optimizer, step.learning_rate, (step.beta1, step.beta2), step.eps, step.weight_decay, step.grad_clip_norm
        )
        finalize_model_grads([trainer.model])
        _, grad_norm, _ = optimizer.step()
        trainer.model.zero_grad_buffer()
        optimizer.zero_grad()
        trainer.optimizer_steps += 1
        return {"grad_norm:mean": float(grad_norm), "learning_rate:mean": step.learning_rate}

    def save(self, directory: str) -> None:
        """The weights (a LoRA model: its adapter) and the optimizer's state, as a job's checkpoint."""
        from inverted.train.checkpoint import save_checkpoint

        save_checkpoint(self.trainer, directory)

    def load(self, directory: str, optimizer: bool) -> None:
        """Weights saved by ``save`` (and with ``optimizer`` its state and step count); gradients start over."""
        from inverted.train.checkpoint import load_checkpoint

        load_checkpoint(self.trainer, directory, optimizer=optimizer)
        self.trainer.model.zero_grad_buffer()
        self.trainer.optimizer.zero_grad()

    def push(self, urls: list[str], keys: ServerKeys, adapter_name: str, version: str, output_dir: str) -> None:
        """The current weights into every rollout server: a LoRA model's adapter as ``adapter_name``, else the
        whole policy (which the servers then serve as their base)."""
        trainer = self.trainer
        if self._sync is None or self._sync.urls != urls:
            self._sync = make_weight_sync(
                trainer.cfg.sync,
                trainer.cfg.hf_checkpoint,
                output_dir,
                urls,
                keys=keys,
                adapter=trainer.adapter_config(),
            )
        self._sync.adapter_name = adapter_name
        trainer.sync_weights(self._sync, version)


def saved_lora(directory: str) -> LoraShape | None:
    """The adapter shape ``Learner.save`` wrote to ``directory`` (None: full weights)."""
    from inverted.train.checkpoint import latest_iteration, read_meta

    latest = latest_iteration(directory)
    if latest is None:
        raise SampleError(f"{directory}: no finished checkpoint")
    peft = read_meta(latest)["lora"]
    if peft is None:
        return None
    modules = set(peft["target_modules"])
    return LoraShape(
        int(peft["r"]),
        train_attn=bool(modules & {"q_proj", "k_proj", "v_proj", "o_proj"}),
        train_mlp=bool(modules & {"gate_proj", "up_proj", "down_proj"}),
        train_unembed=HEAD in modules,
    )


def shared_prefixes(inputs: list[list[int]], least: int = 2) -> list[int]:
    """Each sequence's prompt length for prefix sharing: a run of consecutive sequences shares the
    beginning common to all of it (at least ``least`` tokens); a sequence in no run has a one-token prompt.

    A run takes the next sequence while that costs fewer tokens than starting anew: its common
    beginning may shrink (a group's samples that agree on their first action tokens, then one that
    does not), and each sequence already in the run then runs the lost tokens itself."""
    prompts = [1] * len(inputs)
    start, shared = 0, 0
    for j in range(1, len(inputs) + 1):
        if j < len(inputs):
            common = _common(inputs[start][: shared or None], inputs[j])
            if common >= least and (shared == 0 or (shared - common) * (j - start) < common):
                shared = common
                continue
        if shared:
            prompts[start:j] = [shared] * (j - start)
        start, shared = j, 0
    return prompts


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
