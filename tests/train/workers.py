"""Functions run in each rank of a spawned gloo group (``inverted.train.parallel.spawn``); results go to files."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from inverted.train.config import TrainConfig
from inverted.train.packing import pack
from tests.train.samples import make_samples


@contextlib.contextmanager
def parallel_group(cfg: TrainConfig) -> Iterator[None]:
    """This rank's Megatron parallel state for ``cfg``, torn down whatever the worker did."""
    from inverted.train.parallel import init_parallel, shutdown_parallel

    init_parallel(cfg.parallel, cfg.seed)
    try:
        yield
    finally:
        shutdown_parallel()


def trainer_and_batch(cfg: TrainConfig):
    """A trainer, the test batch (``make_samples(seed=7)``) and its first packed micro-batch."""
    from inverted.train.trainer import Trainer

    trainer = Trainer(cfg)
    samples = make_samples(seed=7)
    return trainer, samples, trainer._plan(samples)[0].micro_batches[0]


def logits_and_step(cfg: TrainConfig, out: str) -> None:
    """Full-vocabulary logits of a packed batch, then one training step: logits, metrics, new weights."""
    with parallel_group(cfg):
        trainer, samples, mb = trainer_and_batch(cfg)
        logits = full_logits(trainer, mb)[: len(mb.tokens_T) - mb.padding]
        metrics = trainer.train(samples)
        weights = trainer.hf_weights()
        if torch.distributed.get_rank() == 0:
            # Where each sample's sequence lies in the packed row (a group's prompt is shared).
            rows = dict(zip(mb.indices, mb.sequence_positions()))
            torch.save({"logits": logits, "rows": rows, "metrics": metrics, "weights": weights}, out)


def check_packed_logits(result: dict, samples, reference) -> None:
    """Each packed sample's rows of ``logits_and_step``'s logits equal ``reference(tokens)`` (full-vocabulary
    logits of the sequence alone) within 1e-4, and every row belongs to some sample."""
    logits, rows = result["logits"], result["rows"]
    with torch.no_grad():
        for i, positions in rows.items():  # under data parallelism, the samples of rank 0's micro-batch
            assert (logits[positions] - reference(samples[i].tokens)).abs().max() <= 1e-4, f"sample {i}"
    assert torch.cat(list(rows.values())).unique().numel() == logits.shape[0]


def full_logits(trainer, mb) -> torch.Tensor:
    """Full-vocabulary logits of a packed micro-batch (gathered over TP; a collective: every rank calls it)."""
    from megatron.core import parallel_state

    with torch.no_grad():
        local = trainer.forward(trainer.model, mb)[0]
        parts = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).cpu()


def step_and_sync(cfg: TrainConfig, samples, urls: list[str], probe: list[int], out: str) -> None:
    """One training step, a weight sync into ``urls``, then the trainer's log-probs of ``probe``."""
    from inverted.train.trainer import Trainer
    from inverted.train.weight_sync import make_weight_sync

    with parallel_group(cfg):
        trainer = Trainer(cfg)
        trainer.train(samples)
        sync = make_weight_sync(cfg.sync, cfg.hf_checkpoint, cfg.output_dir, urls, adapter=trainer.adapter_config())
        try:
            report = trainer.sync_weights(sync, "1")
        finally:
            sync.release()  # its buckets' shared memory: the servers keep what they mapped
        # through the schedule, so that pipeline stages hand the activations on
        probe_mbs = pack([probe], [len(probe) - 1], [0], len(probe), multiple_of=trainer.pad_to)
        logprobs = trainer._no_grad_logprobs(trainer.model, probe_mbs)[0].cpu()
        if torch.distributed.get_rank() == 0:
            torch.save({"logprobs": logprobs, "report": report}, out)


def grpo_step(cfg: TrainConfig, samples, out: str) -> None:
    """Log-probs of every sample's response before and after one training step."""
    from inverted.train.trainer import Trainer

    with parallel_group(cfg):
        trainer = Trainer(cfg)
        mbs = [mb for step in trainer._plan(samples) for mb in step.micro_batches]
        before = trainer._no_grad_logprobs(trainer.model, mbs)
        trainer.train(samples)
        after = trainer._no_grad_logprobs(trainer.model, mbs)
        torch.save({"before": before, "after": after}, out)


def step_at_version(cfg: TrainConfig, samples, version: int, out: str) -> None:
    """One training step by a trainer whose policy is at ``version``: its metrics and new weights."""
    from inverted.train.trainer import Trainer

    with parallel_group(cfg):
        trainer = Trainer(cfg)
        trainer.step = version
        metrics = trainer.train(samples)
        torch.save({"metrics": metrics, "weights": trainer.hf_weights()}, out)


GOOD_FIRST_TOKENS = frozenset(range(3, 2048, 4))  # a quarter of the vocabulary: a random policy lands here 1 time in 4


def grpo_loop(cfg: TrainConfig, url: str, steps: int, out: str) -> None:
    """A minimal synchronous RL loop: generate on the engine, one GRPO step, sync the weights; repeat.

    The reward is 1 when the first sampled token is in ``GOOD_FIRST_TOKENS``. Per step it records the
    mean reward, the weight versions the engine stamped on the samples, and the trainer's
    train/rollout log-prob mismatch (which is ~0 only if the engine holds exactly the trainer's weights).
    """
    import random

    import httpx

    from inverted.train.trainer import Trainer
    from inverted.train.weight_sync import make_weight_sync
    from inverted.types import Sample

    with parallel_group(cfg):
        trainer, sync, rng = (
            Trainer(cfg),
            make_weight_sync(cfg.sync, cfg.hf_checkpoint, cfg.output_dir, [url]),
            random.Random(0),
        )
        try:
            history = []
            for step in range(steps):
                prompts = [[rng.randrange(3, 1000) for _ in range(4)] for _ in range(16)]
                answers = httpx.post(
                    url + "/generate",
                    timeout=120,
                    json={
                        "input_ids": prompts,
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "n": 8, "ignore_eos": True},
                    },
                ).json()
                samples = []
                for j, answer in enumerate(answers):
                    ids = answer["output_ids"]
                    samples.append(
                        Sample(
                            group_index=j // 8,
                            index=j,
                            tokens=prompts[j // 8] + ids,
                            response_length=len(ids),
                            loss_mask=[1] * len(ids),
                            rollout_log_probs=[t[0] for t in answer["meta_info"]["output_token_logprobs"]],
                            weight_versions=[answer["meta_info"]["weight_version"]] * len(ids),
                            reward=float(ids[0] in GOOD_FIRST_TOKENS),
                            status=Sample.Status.COMPLETED,
                        )
                    )
                metrics = trainer.train(samples)
                trainer.sync_weights(sync, str(step + 1))
                history.append(
                    {
                        "reward": sum(s.reward for s in samples) / len(samples),
                        "versions": sorted({v for s in samples for v in s.weight_versions}),
                        "mismatch": metrics["train/train_rollout_logprob_abs_diff"],
                    }
                )
        finally:
            sync.release()  # its buckets' shared memory: the server keeps what it mapped
        torch.save(history, out)


def logprobs_step_and_save(cfg: TrainConfig, samples, save: str, out: str) -> None:
    """Response log-probs through the schedule, one training step, a checkpoint in ``save``: what rank 0 sees."""
    from inverted.train.checkpoint import save_checkpoint
    from inverted.train.trainer import Trainer

    with parallel_group(cfg):
        trainer = Trainer(cfg)
        mbs = [mb for step in trainer._plan(samples) for mb in step.micro_batches]
        logprobs = trainer._no_grad_logprobs(trainer.model, mbs)
        metrics = trainer.train(samples)
        weights = trainer.hf_weights()
        adapter = dict(trainer.adapter_weights()) if trainer.lora is not None else {}
        save_checkpoint(trainer, save)
        if torch.distributed.get_rank() == 0:
            torch.save({"logprobs": logprobs, "metrics": metrics, "weights": weights, "adapter": adapter}, out)


def straight_and_resumed(cfg: TrainConfig, batches, save: str, out: str) -> None:
    """The weights after training on every batch in one go, and after a checkpoint three batches in and a resume."""
    from inverted.train.checkpoint import load_checkpoint, save_checkpoint
    from inverted.train.trainer import Trainer

    with parallel_group(cfg):
        straight = Trainer(cfg)
        start = {name: t.float().cpu() for name, t in straight.hf_weights().items()}
        for batch in batches:
            straight.train(batch)
        weights = {"start": start, "straight": straight.hf_weights()}
        del straight
        first = Trainer(cfg)
        for batch in batches[:3]:
            first.train(batch)
        save_checkpoint(first, save)
        del first
        resumed = Trainer(cfg)
        load_checkpoint(resumed, save)
        for batch in batches[3:]:
            resumed.train(batch)
        weights["resumed"] = resumed.hf_weights()
        if torch.distributed.get_rank() == 0:
            torch.save({k: {n: t.float().cpu() for n, t in w.items()} for k, w in weights.items()}, out)


def lora_step(cfg: TrainConfig, out: str) -> None:
    """A LoRA trainer's logits of a packed batch, then one step: what changed, the adapter, new logits."""
    with parallel_group(cfg):
        trainer, samples, mb = trainer_and_batch(cfg)

        def state() -> dict:  # copies: gathered tensors may be the live parameters themselves
            return {
                "logits": full_logits(trainer, mb),
                "base": {k: v.clone() for k, v in trainer.hf_weights().items()},
                "adapter": {k: v.clone() for k, v in trainer.adapter_weights()},
            }

        before = state()
        metrics = trainer.train(samples)
        after = state()
        trainable = sorted(n for n, p in trainer.model.module.named_parameters() if p.requires_grad)
        if torch.distributed.get_rank() == 0:
            rows = dict(zip(mb.indices, mb.sequence_positions()))
            torch.save(
                {"before": before, "after": after, "metrics": metrics, "rows": rows, "trainable": trainable}, out
            )


def train_each(cfgs: list[TrainConfig], samples, out: str) -> None:
    """One rollout trained under each config in turn, a fresh trainer each from the same weights: their metrics."""
    from inverted.train.trainer import Trainer

    with parallel_group(cfgs[0]):
        metrics = [Trainer(cfg).train(samples) for cfg in cfgs]
        if torch.distributed.get_rank() == 0:
            torch.save(metrics, out)


def check_same_training(one: dict, many: dict, checkpoint, out, metrics: tuple[str, ...]) -> None:
    """``logprobs_step_and_save`` under a parallel layout (``many``) gave one process's results (``one``):
    the log-probs of its rank 0's samples, ``metrics``, the weights it gathered (and a LoRA run's
    adapter); and its checkpoint exports to exactly those weights (a LoRA run's: that adapter)."""
    import pytest
    from safetensors.torch import load_file

    from inverted.peft_adapter import WEIGHTS_FILE
    from inverted.train.export import export_hf

    for index, logprobs in many["logprobs"].items():
        torch.testing.assert_close(logprobs, one["logprobs"][index], rtol=0, atol=1e-5)
    for name in metrics:
        assert many["metrics"][name] == pytest.approx(one["metrics"][name], rel=1e-5, abs=1e-9), name
    trained = "adapter" if one["adapter"] else "weights"
    for part in ("weights", "adapter"):
        assert many[part].keys() == one[part].keys()
        for name, tensor in one[part].items():
            torch.testing.assert_close(many[part][name], tensor, rtol=0, atol=1e-6)
    exported = load_file(export_hf(checkpoint, out) / (WEIGHTS_FILE if one["adapter"] else "model.safetensors"))
    assert exported.keys() == many[trained].keys()
    for name, tensor in many[trained].items():
        assert torch.equal(exported[name], tensor), name


def head_paths(cfg: TrainConfig, out: str, kept=None, adapted: bool = False) -> None:
    """Log-probs, entropies and their gradients (a random upstream gradient of each) at temperature 0.7
    through the fused head (chunks of 8 tokens) and through the logits path, on this rank's vocabulary
    slice of one random output layer; the weight's gradient gathered over TP. ``kept``: the rows' kept
    sets (``KeptSets``), replayed by both; each path's whole-vocabulary log-probs beside. ``adapted``: the
    output layer has a rank-3 adapter (random low-rank activations and ``B``; ``B`` split over TP as the
    weight), whose gradients come too. What rank 0 sees."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from inverted.train.logprobs import fused_logprobs_and_entropy, token_logprobs_and_entropy

    with parallel_group(cfg):
        g = torch.Generator().manual_seed(0)
        hidden, weight = torch.randn(37, 16, generator=g), torch.randn(96, 16, generator=g)
        targets = torch.randint(0, 96, (37,), generator=g)
        upstream = torch.randn(2, 37, generator=g)
        low, b = torch.randn(37, 3, generator=g), torch.randn(96, 3, generator=g) * 0.5
        size, rank = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank(),
        )
        group = parallel_state.get_tensor_model_parallel_group()
        results = {"inputs": (hidden, weight, targets, upstream, low, b)}

        def gathered(grad: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(grad) for _ in range(size)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=group)
            return torch.cat(parts)

        for path in ("fused", "logits"):
            h, w = hidden.clone().requires_grad_(), weight.chunk(size)[rank].clone().requires_grad_()
            lo, bl = low.clone().requires_grad_(), b.chunk(size)[rank].clone().requires_grad_()
            shared = copy_to_tensor_model_parallel_region(h, group=group)
            shared_low = copy_to_tensor_model_parallel_region(lo, group=group)
            keep = kept.mask(slice(0, 37), rank * len(w), len(w), "cpu") if kept is not None else None
            if path == "fused":
                low_rank = (shared_low, bl) if adapted else None
                head = fused_logprobs_and_entropy(shared, w, targets, 0.7, chunk=8, kept=kept, low_rank=low_rank)
            else:
                logits = shared @ w.t() + (shared_low @ bl.t() if adapted else 0)
                head = token_logprobs_and_entropy(logits, targets, 0.7, keep=keep)
            (head.logprobs * upstream[0] + head.entropy * upstream[1]).sum().backward()
            results[path] = (head.logprobs.detach(), head.entropy.detach(), h.grad, gathered(w.grad))
            if adapted:
                results[path] += (lo.grad, gathered(bl.grad))
            results[f"{path}_unmasked"] = head.unmasked
        if torch.distributed.get_rank() == 0:
            torch.save(results, out)


def heads_and_steps(cfgs: list[TrainConfig], samples, out: str) -> None:
    """Under each config in turn, a fresh trainer from the same weights: its no-grad log-probs of
    ``samples``, then one training step's metrics and weights."""
    from inverted.train.trainer import Trainer

    with parallel_group(cfgs[0]):
        results = []
        for cfg in cfgs:
            trainer = Trainer(cfg)
            mbs = [mb for step in trainer._plan(samples) for mb in step.micro_batches]
            logprobs = trainer._no_grad_logprobs(trainer.model, mbs)
            results.append(
                {
                    "fused": trainer.fused_head,
                    "logprobs": logprobs,
                    "metrics": trainer.train(samples),
                    "weights": trainer.hf_weights(),
                }
            )
            del trainer
        torch.save(results, out)


def step_save_and_finish(cfg: TrainConfig, samples, root: str, hf_out: str, out: str) -> None:
    """A rank as the job ends it (``TrainActor``'s ``train``, ``save``, then ``finish``): how much of
    its training state (parameters, Adam's moments) was still alive when the export began, and its
    trained weights to hold the export to."""
    import weakref

    from inverted.processes import freeze_startup_heap
    from inverted.train import export
    from inverted.train.actor import TrainActor
    from inverted.train.trainer import Trainer

    with parallel_group(cfg), contextlib.ExitStack() as stack:
        stack.callback(gc.unfreeze)  # this may be the test's own process
        actor = TrainActor()
        actor.cfg, actor.rank = cfg, torch.distributed.get_rank()
        actor.trainer = Trainer(cfg)
        freeze_startup_heap()  # as ``TrainActor.setup`` does
        actor.trainer.train(samples)  # the step's Samples, as the rank reads them from the buffer
        weights = {name: tensor.clone() for name, tensor in actor.trainer.hf_weights().items()}
        state = [
            *actor.trainer.model.parameters(),
            *(t for s in actor.trainer.optimizer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
        ]
        alive = [weakref.ref(tensor) for tensor in state]
        del state
        actor.save(root)
        seen: dict[str, int] = {}
        exporting = export.export_hf

        def watched(*args):
            seen["alive"] = sum(ref() is not None for ref in alive)
            return exporting(*args)

        export.export_hf = watched
        try:
            path = actor.finish(root, hf_out)
        finally:
            export.export_hf = exporting
        if actor.rank == 0:
            torch.save({"alive_at_export": seen["alive"], "tracked": len(alive), "path": path, "weights": weights}, out)
