"""The Megatron Mixture-of-Experts policy equals ``transformers``, and expert parallelism changes nothing.

Megatron's ``MoELayer`` (router, experts, all-to-all dispatch over gloo) is built from the HF config
and loaded through the name table, experts numbered globally; these tests run it against HF's own
Qwen3-MoE and Qwen2-MoE, and a training step with the experts split over two ranks against one.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from inverted.config import from_flags
from inverted.errors import ModelError
from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors
from inverted.train.config import TrainConfig
from inverted.train.convert import check_compatible
from inverted.train.parallel import spawn
from tests.conftest import MOE_ARCHS
from tests.train.samples import make_samples
from tests.train.test_weight_sync import PROBE, engine_logprobs
from tests.train.workers import (
    check_packed_logits,
    check_same_training,
    logits_and_step,
    logprobs_step_and_save,
    step_and_sync,
)


def run(path, tmp_path, ep: int) -> dict:
    # adam_eps=1 makes the step nearly linear in the gradient, so equal weights mean equal gradients.
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(path),
        lr=1e-2,
        adam_eps=1.0,
        max_tokens_per_gpu=8192,
        expert_model_parallel_size=ep,
        actor_num_gpus_per_node=ep,
    )
    spawn(logits_and_step, ep, cfg, str(tmp_path / f"ep{ep}.pt"))
    return torch.load(tmp_path / f"ep{ep}.pt")


def hf_reference(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return lambda tokens: hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_equal_transformers(arch, tiny_model, tmp_path):
    path = tiny_model(arch)
    result = run(path, tmp_path, ep=1)
    check_packed_logits(result, make_samples(seed=7), hf_reference(path))
    assert result["weights"].keys() == checkpoint_tensors(path).keys()  # every expert, router and norm, in HF names


@pytest.mark.slow  # several ranks: left out of make test-fast
def test_experts_split_over_two_ranks_give_the_same_logits_and_step(tiny_model, tmp_path):
    """EP=2: each rank holds 4 of the 8 experts and tokens cross ranks all-to-all; the logits equal
    transformers', and one step gives the weights (every expert, in HF names) that EP=1 gives."""
    path = tiny_model("qwen2_moe")
    results = {ep: run(path, tmp_path, ep) for ep in (1, 2)}
    check_packed_logits(results[2], make_samples(seed=7), hf_reference(path))
    for name in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert results[2]["metrics"][name] == pytest.approx(results[1]["metrics"][name], rel=1e-5, abs=1e-7), name
    assert results[2]["weights"].keys() == results[1]["weights"].keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in results[2]["weights"]
    for name, tensor in results[1]["weights"].items():
        torch.testing.assert_close(results[2]["weights"][name], tensor, rtol=0, atol=1e-5)


@pytest.mark.slow  # several ranks: left out of make test-fast
def test_two_stages_with_experts_over_two_ranks_equal_one_process_and_export(tiny_model, tmp_path):
    """PP=2 x EP=2 (four gloo ranks: each stage's experts split 4 + 4, two data-parallel replicas)
    against one process: log-probs, two optimizer steps, the weights gathered over stages and
    experts, and the four-rank checkpoint exported to exactly those weights."""
    path, samples = str(tiny_model("qwen2_moe")), make_samples(seed=7)
    results = {}
    for pp, ep in ((1, 1), (2, 2)):
        cfg = from_flags(
            TrainConfig,
            hf_checkpoint=path,
            lr=1e-2,
            adam_eps=1.0,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            actor_num_gpus_per_node=pp * ep,
            max_tokens_per_gpu=24,
            global_batch_size=4,
        )
        spawn(logprobs_step_and_save, pp * ep, cfg, samples, str(tmp_path / f"ckpt{pp}"), str(tmp_path / f"{pp}.pt"))
        results[pp] = torch.load(tmp_path / f"{pp}.pt")
    check_same_training(
        results[1],
        results[2],
        tmp_path / "ckpt2",
        tmp_path / "hf",
        ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm", "train/loss_tokens"),
    )


@pytest.mark.slow  # several ranks: left out of make test-fast
@pytest.mark.parametrize("ep", [1, 2])
def test_tensor_parallel_experts_with_sequence_parallelism_equal_one_process(ep, tiny_model, tmp_path):
    """TP=2 with sequence parallelism (each rank holds half of every expert and shared expert, and
    half of each packed row outside attention; rows padded to an even length), alone and with EP=2
    on four ranks, against one process: log-probs, two optimizer steps, the gathered weights and
    the exported checkpoint. Alone it trains the load-balancing loss too; with EP=2 there are two
    data-parallel replicas, and that loss, taken per micro-batch, differs with the split."""
    path, samples = str(tiny_model("qwen2_moe")), make_samples(seed=7)
    aux = 0.5 if ep == 1 else 0.0
    results = {}
    for tp, experts_over in ((1, 1), (2, ep)):
        cfg = from_flags(
            TrainConfig,
            hf_checkpoint=path,
            lr=1e-2,
            adam_eps=1.0,
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=experts_over,
            sequence_parallel=tp > 1,
            actor_num_gpus_per_node=tp * experts_over,
            max_tokens_per_gpu=25,
            global_batch_size=4,
            moe_aux_loss_coeff=aux,
        )
        spawn(
            logprobs_step_and_save,
            cfg.parallel.world_size,
            cfg,
            samples,
            str(tmp_path / f"ckpt{tp}"),
            str(tmp_path / f"{tp}.pt"),
        )
        results[tp] = torch.load(tmp_path / f"{tp}.pt")
    metrics = ("train/loss", "train/entropy", "train/grad_norm", "train/loss_tokens")
    check_same_training(
        results[1], results[2], tmp_path / "ckpt2", tmp_path / "hf", metrics + (("train/moe_aux_loss",) if aux else ())
    )


def test_expert_parallelism_that_does_not_fit_and_lora_are_refused(tiny_model):
    moe, dense = (ModelSpec.from_checkpoint(tiny_model(arch)) for arch in ("qwen3_moe", "qwen2"))
    with pytest.raises(ModelError, match="--expert-model-parallel-size 3 does not divide the model's 8 experts"):
        check_compatible(moe, 1, 1, 3)
    with pytest.raises(ModelError, match="--expert-model-parallel-size 2 does not divide"):
        check_compatible(dense, 1, 1, 2)
    with pytest.raises(ModelError, match="tensor parallelism of a Mixture-of-Experts model needs --sequence-parallel"):
        check_compatible(moe, 2)
    check_compatible(moe, 1, 1, 4)
    check_compatible(moe, 2, 1, 2, sequence_parallel=True)
    with pytest.raises(ModelError, match="is a Mixture-of-Experts model: --lora-rank adapts dense models only"):
        from inverted.train.trainer import Trainer

        Trainer(from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen3_moe")), lora_rank=4))


@pytest.mark.parametrize(
    "transport, pp, tp", [("tensor", 1, 1), ("distributed", 1, 1), ("tensor", 2, 1), ("distributed", 1, 2)]
)
@pytest.mark.slow  # several ranks: left out of make test-fast
def test_after_a_step_at_ep2_and_a_sync_the_engine_scores_tokens_as_the_trainer_does(
    transport, pp, tp, module_procs, tiny_model, tmp_path
):
    """Every expert of both expert-parallel ranks reaches the engine, checked by name and shape there;
    with two pipeline stages too (four ranks: each stage gathers its experts, the second sends them on),
    or with TP=2 (four ranks: each expert's halves are gathered over its TP group, then over EP)."""
    path = tiny_model("qwen3_moe")
    engine = module_procs.engine(path, name=f"moe-{transport}-{pp}-{tp}")
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(path),
        lr=3e-2,
        adam_eps=1.0,
        output_dir=str(tmp_path),
        update_weight_transport=transport,
        update_weight_buffer_size=1 << 20,
        expert_model_parallel_size=2,
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        actor_num_gpus_per_node=2 * pp * tp,
    )
    before, _ = engine_logprobs(engine.url)
    spawn(step_and_sync, 2 * pp * tp, cfg, make_samples(seed=3), [engine.url], PROBE, str(tmp_path / "out.pt"))
    result = torch.load(tmp_path / "out.pt", weights_only=False)
    assert result["report"].bytes == sum(t.numel() * 4 for t in checkpoint_tensors(path).values())  # every expert
    after, version = engine_logprobs(engine.url)
    assert version == "1"
    assert (after - result["logprobs"]).abs().max() <= 1e-4
    assert (before - result["logprobs"]).abs().max() > 1e-3, "the step must have changed the policy"
