"""Log-probs without the full logits (``train/logprobs.py``): the fused head against the logits path and an
exact fp64 recomputation, under tensor parallelism too; on the real model, the trainer's log-probs and its
step through the fused head, with every layer recomputed or none, against the logits path and ``transformers``."""

from __future__ import annotations

import pytest
import torch
import transformers

from inverted.config import from_flags
from inverted.train.config import TrainConfig
from inverted.train.packing import KeptSets
from inverted.train.parallel import spawn
from tests.train.samples import make_samples
from tests.train.workers import head_paths, heads_and_steps


def kept_sets(targets: torch.Tensor, vocab: int) -> KeptSets:
    """Kept sets for 37 rows as a sampler leaves them: none on every third row (sampled whole), else each
    row's target with up to 30 other ids, spread over both halves of the vocabulary (both TP ranks)."""
    g = torch.Generator().manual_seed(1)
    ids, offsets = [], [0]
    for row, target in enumerate(targets.tolist()):
        if row % 3:
            others = torch.randperm(vocab, generator=g)[: int(torch.randint(0, 31, (1,), generator=g))].tolist()
            ids += [target] + [t for t in others if t != target]
        offsets.append(len(ids))
    return KeptSets(torch.tensor(offsets), torch.tensor(ids))


@pytest.mark.parametrize(
    ("masked", "adapted"), [(False, False), (True, False), (False, True)], ids=["whole", "kept_sets", "adapted"]
)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # two ranks: slow
def test_fused_head_equals_the_logits_path_and_an_exact_recomputation(tp, masked, adapted, tiny_model, tmp_path):
    """37 tokens in chunks of 8 (the last one short), each TP rank holding half the vocabulary: log-probs,
    entropies and the gradients of hidden states and weight equal fp64's; the log-probs and entropies equal
    the logits path's within 1e-6, and the gradients (the same derivatives, written out) within fp32's rounding.
    With kept sets (sampling masks) every row that has one is a softmax over it alone, in fp64 too, and
    the whole vocabulary's log-probs come beside. With an adapted output layer (LoRA on ``lm_head``) its
    low-rank product is in the logits, and the gradients of its activations and ``B`` are exact too."""
    cfg = from_flags(
        TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), tensor_model_parallel_size=tp, actor_num_gpus_per_node=tp
    )
    inputs = torch.Generator().manual_seed(0)  # head_paths' own draws, for the targets the sets must hold
    torch.randn(37, 16, generator=inputs), torch.randn(96, 16, generator=inputs)
    kept = kept_sets(torch.randint(0, 96, (37,), generator=inputs), 96) if masked else None
    spawn(head_paths, tp, cfg, str(tmp_path / "heads.pt"), kept, adapted)
    results = torch.load(tmp_path / "heads.pt")
    hidden, weight, targets, upstream, low, b = (t.double() if t.is_floating_point() else t for t in results["inputs"])
    hidden.requires_grad_(), weight.requires_grad_(), low.requires_grad_(), b.requires_grad_()
    logits = (hidden @ weight.t() + (low @ b.t() if adapted else 0)) / 0.7
    whole = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    if kept is not None:
        keep = kept.mask(slice(0, 37), 0, 96, "cpu")
        assert keep[torch.arange(37), targets].all() and not keep.all()
        logits = logits.masked_fill(~keep, -1e4)  # exp() of it is exactly 0 in fp64, and no gradient flows there
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    (logp * upstream[0] + entropy * upstream[1]).sum().backward()
    for path in ("fused", "logits"):
        if kept is None:
            assert results[f"{path}_unmasked"] is None
        else:
            torch.testing.assert_close(results[f"{path}_unmasked"].double(), whole.detach(), rtol=1e-5, atol=1e-5)
            assert (logp.detach() - whole.detach()).abs().max() > 0.1  # the sets matter
    exact = (logp.detach(), entropy.detach(), hidden.grad, weight.grad)
    names: tuple[str, ...] = ("log-probs", "entropies", "hidden states' gradient", "weight's gradient")
    if adapted:
        exact += (low.grad, b.grad)
        names += ("low-rank activations' gradient", "B's gradient")
        assert len(results["fused"]) == 6
    for path in ("fused", "logits"):
        for name, got, want in zip(names, results[path], exact):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=f"{path}: {name}")
    for name, fused, logits in zip(names[:2], results["fused"][:2], results["logits"][:2]):
        assert (fused - logits).abs().max() <= 1e-6, name
    for name, fused, logits in zip(names[2:], results["fused"][2:], results["logits"][2:]):  # other formulas
        assert (fused - logits).norm() <= 1e-6 * logits.norm(), name


@pytest.mark.slow  # the real model: left out of make test-fast
def test_the_trainer_without_full_logits_equals_the_logits_path_on_the_real_model(smollm2, tmp_path):
    """SmolLM2-135M: the trainer's log-probs through the fused head (one chunk; chunks of 5 tokens with every
    layer recomputed, or their attention) equal the logits path's within 1e-6 and ``transformers``' within
    1e-4; one step of each gives the same metrics and weights."""
    samples = make_samples(seed=7)
    common = dict(hf_checkpoint=str(smollm2), lr=1e-2, adam_eps=1.0)
    cfgs = [
        from_flags(TrainConfig, **common, logprob_chunk_size=0, recompute_granularity="none"),
        from_flags(TrainConfig, **common, logprob_chunk_size=1024, recompute_granularity="none"),
        from_flags(TrainConfig, **common, logprob_chunk_size=5, recompute_granularity="full"),
        from_flags(TrainConfig, **common, logprob_chunk_size=5, recompute_granularity="selective"),
    ]
    spawn(heads_and_steps, 1, cfgs, samples, str(tmp_path / "runs.pt"))
    logits_path, *fused = torch.load(tmp_path / "runs.pt")
    assert not logits_path["fused"] and all(run["fused"] for run in fused)

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.no_grad():
        for i, sample in enumerate(samples):
            logits = hf(torch.tensor([sample.tokens])).logits[0, -sample.response_length - 1 : -1]
            expected = logits.log_softmax(-1).gather(
                -1, torch.tensor(sample.tokens[-sample.response_length :])[:, None]
            )
            torch.testing.assert_close(logits_path["logprobs"][i], expected[:, 0], rtol=0, atol=1e-4)
    for run in fused:
        for i, logprobs in logits_path["logprobs"].items():
            # 1e-6 of the log-prob's size: the logits path's own values move that much with the rows packed
            # beside them (a GEMM of a few rows takes another kernel: ~1 ulp of the logits).
            torch.testing.assert_close(run["logprobs"][i], logprobs, rtol=1e-6, atol=1e-6, msg=f"sample {i}")
        for name in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
            assert run["metrics"][name] == pytest.approx(logits_path["metrics"][name], rel=1e-5, abs=1e-9), name
        for name, tensor in logits_path["weights"].items():
            # One rounding of the stored weight at most: fp32's step between neighbours is 1.2e-7 at 1.0, so an
            # absolute 1e-7 failed on a norm weight above 1 (AMD EPYC, without AMX: 1.19e-7 apart, one ulp).
            torch.testing.assert_close(
                run["weights"][name], tensor, rtol=torch.finfo(torch.float32).eps, atol=1e-7, msg=name
            )
