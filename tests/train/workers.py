"""Functions run in each rank of a spawned gloo group (``inverted.train.parallel.spawn``); results go to files."""

from __future__ import annotations

import torch

from inverted.config import TrainConfig
from tests.train.samples import make_samples


def logits_and_step(cfg: TrainConfig, out: str) -> None:
    """Full-vocabulary logits of a packed batch, then one training step: logits, metrics, new weights."""
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    init_parallel(cfg)
    try:
        trainer = Trainer(cfg)
        samples = make_samples(seed=7)
        mb = trainer._plan(samples)[0].micro_batches[0]
        logits = full_logits(trainer, mb.tokens_T, mb.positions_T, mb.cu_seqlens, mb.max_seqlen)
        metrics = trainer.train(samples)
        weights = trainer.hf_weights()
        if torch.distributed.get_rank() == 0:
            torch.save({"logits": logits, "metrics": metrics, "weights": weights}, out)
    finally:
        shutdown_parallel()


def full_logits(trainer, tokens_T, positions_T, cu_seqlens, max_seqlen) -> torch.Tensor:
    """Full-vocabulary logits of packed sequences (gathered over TP; a collective: every rank calls it)."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    with torch.no_grad():
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        local = trainer.model(input_ids=tokens_T[None], position_ids=positions_T[None], attention_mask=None,
                              packed_seq_params=params)[0]
        parts = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def step_and_sync(cfg: TrainConfig, samples, urls: list[str], probe: list[int], out: str) -> None:
    """One training step, a weight sync into ``urls``, then the trainer's log-probs of ``probe``."""
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer
    from inverted.train.weight_sync import make_weight_sync

    init_parallel(cfg)
    try:
        trainer = Trainer(cfg)
        trainer.train(samples)
        report = trainer.sync_weights(make_weight_sync(cfg, urls), "1")
        tokens = torch.tensor(probe)
        logits = full_logits(trainer, tokens, torch.arange(len(probe)), torch.tensor([0, len(probe)], dtype=torch.int32),
                             len(probe))
        logprobs = torch.log_softmax(logits.float(), dim=-1)[:-1].gather(1, tokens[1:, None])[:, 0]
        if torch.distributed.get_rank() == 0:
            torch.save({"logprobs": logprobs, "report": report}, out)
    finally:
        shutdown_parallel()


def grpo_step(cfg: TrainConfig, samples, out: str) -> None:
    """Log-probs of every sample's response before and after one training step."""
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    init_parallel(cfg)
    try:
        trainer = Trainer(cfg)
        mbs = [mb for step in trainer._plan(samples) for mb in step.micro_batches]
        before = trainer._no_grad_logprobs(trainer.model, mbs)
        trainer.train(samples)
        after = trainer._no_grad_logprobs(trainer.model, mbs)
        torch.save({"before": before, "after": after}, out)
    finally:
        shutdown_parallel()
