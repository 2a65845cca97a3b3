"""Functions run in each rank of a spawned gloo group (``inverted.train.parallel.spawn``); results go to files."""

from __future__ import annotations

import torch

from inverted.config import TrainConfig
from tests.train.samples import make_samples


def logits_and_step(cfg: TrainConfig, out: str) -> None:
    """Full-vocabulary logits of a packed batch, then one training step: logits, metrics, new weights."""
    from megatron.core import parallel_state

    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    init_parallel(cfg)
    try:
        trainer = Trainer(cfg)
        samples = make_samples(seed=7)
        mb = trainer._plan(samples)[0].micro_batches[0]
        with torch.no_grad():
            from megatron.core.packed_seq_params import PackedSeqParams

            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                                     max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            local = trainer.model(input_ids=mb.tokens_T[None], position_ids=mb.positions_T[None], attention_mask=None,
                                  packed_seq_params=params)[0]
            tp = parallel_state.get_tensor_model_parallel_world_size()
            parts = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        metrics = trainer.train(samples)
        weights = trainer.hf_weights()
        if torch.distributed.get_rank() == 0:
            torch.save({"logits": torch.cat(parts, dim=-1), "metrics": metrics, "weights": weights}, out)
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
