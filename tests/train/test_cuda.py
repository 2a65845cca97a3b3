"""The Megatron trainer on a CUDA GPU: NCCL, Megatron's own optimizer, CUDA-IPC sync (skipped without one).

On CPU the trainer runs through ``train/megatron_patches.py`` and its own AdamW; here none of that is
used, so these tests are the proof that the GPU path is the same learner: the same logits as
``transformers``, a GRPO step that moves the policy the right way with Megatron's (optionally
distributed) optimizer in bf16, a resume that continues exactly with either optimizer, and a
step followed by a CUDA-IPC sync after which the engine on the same GPU scores tokens exactly as
the trainer does.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from inverted.config import from_flags
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from tests.conftest import ARCHS, MOE_ARCHS
from tests.train.samples import make_samples
from tests.train.test_weight_sync import PROBE, engine_logprobs
from tests.train.workers import check_packed_logits, grpo_step, logits_and_step, step_and_sync, straight_and_resumed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none"),
]


@pytest.mark.parametrize("arch", [*ARCHS, *MOE_ARCHS])
def test_cuda_logits_equal_transformers(arch, tiny_model, tmp_path):
    path = tiny_model(arch)
    spawn(logits_and_step, 1, from_flags(TrainConfig, hf_checkpoint=str(path)), str(tmp_path / "out.pt"))
    result = torch.load(tmp_path / "out.pt", weights_only=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    check_packed_logits(
        result, make_samples(seed=7), lambda tokens: hf(torch.tensor([tokens], device="cuda")).logits[0].cpu()
    )


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_cuda_bf16_grpo_step_raises_the_rewarded_answer(distributed_optimizer, tiny_model, tmp_path):
    samples = make_samples(seed=3, groups=1, per_group=4)
    for i, sample in enumerate(samples):
        sample.reward = 1.0 if i == 2 else 0.0
        sample.loss_mask = [1] * sample.response_length
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(tiny_model("qwen2")),
        lr=1e-3,
        bf16=True,
        use_distributed_optimizer=distributed_optimizer,
    )
    spawn(grpo_step, 1, cfg, samples, str(tmp_path / "grpo.pt"))
    result = torch.load(tmp_path / "grpo.pt", weights_only=False)
    gain = {i: float(result["after"][i].sum() - result["before"][i].sum()) for i in range(4)}
    assert gain[2] > 0.01, gain
    assert all(gain[i] < 0 for i in (0, 1, 3)), gain


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_cuda_resume_continues_the_uninterrupted_run(distributed_optimizer, tiny_model, tmp_path):
    """3 steps, save, resume, 2 more == 5 straight, in fp32 so that only a lost state could differ:
    Adam's moments restarted from zero would move the weights by ~lr, 1e3 times the tolerance."""
    cfg = from_flags(
        TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), lr=1e-3, use_distributed_optimizer=distributed_optimizer
    )
    batches = [make_samples(seed=20 + i) for i in range(5)]
    spawn(straight_and_resumed, 1, cfg, batches, str(tmp_path / "ckpt"), str(tmp_path / "out.pt"))
    weights = torch.load(tmp_path / "out.pt")
    for name, straight in weights["straight"].items():
        assert (straight - weights["start"][name]).abs().max() > 1e-3, f"{name} did not train"
        assert (weights["resumed"][name] - straight).abs().max() <= 1e-6, name


def test_cuda_step_then_cuda_ipc_sync_lands_exactly(procs, tiny_model, tmp_path):
    path = tiny_model("qwen2")
    url = procs.engine(path, "--device", "cuda", "--dtype", "float32").url
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(path),
        lr=1e-2,
        update_weight_transport="tensor",
        update_weight_buffer_size=1 << 20,
    )
    spawn(step_and_sync, 1, cfg, make_samples(seed=1), [url], PROBE, str(tmp_path / "out.pt"))
    result = torch.load(tmp_path / "out.pt", weights_only=False)
    assert result["report"].transport == "tensor" and result["report"].buckets >= 1
    got, version = engine_logprobs(url)
    assert version == "1"
    assert (got - result["logprobs"]).abs().max() <= 1e-4
