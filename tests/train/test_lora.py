"""LoRA in the Megatron trainer against ``peft``: logits, tensor parallelism, what a step changes, export."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from inverted.config import from_flags
from inverted.peft_adapter import LoRAConfig, write_adapter
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from tests.train.samples import make_samples
from tests.train.workers import check_packed_logits, lora_step

MODULES = ("q_proj", "v_proj", "up_proj", "down_proj", "lm_head")


def peft_adapter(base, out, rank: int = 4, modules="all-linear", seed: int = 1):
    """An adapter made by ``peft`` with random A and B (so it changes every adapted layer's output)."""
    torch.manual_seed(seed)
    model = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        LoraConfig(r=rank, lora_alpha=8, target_modules=modules, init_lora_weights=False),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(out)
    return out


def peft_logits(base, adapter):
    model = PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    )
    model.eval()
    return lambda tokens: model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module")
def lora_runs(tiny_model, tmp_path_factory):
    """One step from a peft adapter (q/v/up/down: parts of both fused linears; and the output layer, which
    the model ties to its embedding) at TP=1 and TP=2, each run when a test first reads it (a fast run reads
    only TP=1's)."""
    path, root = tiny_model("qwen3"), tmp_path_factory.mktemp("lora")
    adapter = peft_adapter(path, root / "start", modules=list(MODULES))

    @functools.cache
    def run(tp: int) -> dict:
        cfg = from_flags(
            TrainConfig,
            hf_checkpoint=str(path),
            lr=1e-2,
            adam_eps=1.0,
            tensor_model_parallel_size=tp,
            actor_num_gpus_per_node=tp,
            lora_adapter_path=str(adapter),
            max_tokens_per_gpu=8192,
            use_kl_loss=True,
            kl_loss_coef=0.1,
        )
        spawn(lora_step, tp, cfg, str(root / f"tp{tp}.pt"))
        return torch.load(root / f"tp{tp}.pt")

    return path, adapter, run, root


def test_lora_logits_equal_peft_and_a_step_changes_only_the_adapter(lora_runs):
    path, adapter, run, root = lora_runs
    one = run(1)
    check_packed_logits(
        {"logits": one["before"]["logits"], "rows": one["rows"]}, make_samples(seed=7), peft_logits(path, adapter)
    )
    assert all(".lora." in name for name in one["trainable"])
    assert len(one["trainable"]) == 2 * 4 * 2 + 2  # A, B x 4 modules x 2 layers, and the output layer's
    for name, tensor in one["before"]["base"].items():
        assert torch.equal(one["after"]["base"][name], tensor), name
    assert one["before"]["adapter"].keys() == one["after"]["adapter"].keys()
    assert all(not torch.equal(one["after"]["adapter"][n], t) for n, t in one["before"]["adapter"].items())
    assert one["metrics"]["train/kl"] > 0  # the reference is the base model: the adapter already moved away from it

    # The adapter after the step, written as PEFT's directory, loads in peft and gives the trainer's logits.
    written = write_adapter(root / "after", LoRAConfig(4, 8.0, MODULES), one["after"]["adapter"])
    check_packed_logits(
        {"logits": one["after"]["logits"], "rows": one["rows"]}, make_samples(seed=7), peft_logits(path, written)
    )


@pytest.mark.parametrize(
    "spans",
    [
        ((slice(None), slice(None)),),  # one product over every column (q/k/v, the row-parallel linears)
        ((slice(0, 3), slice(0, 5)), (slice(3, 6), slice(5, 10))),  # gate and up, each its own block
        ((slice(0, 3), slice(5, 10)),),  # up alone: the gate columns pass through unchanged
    ],
)
def test_the_adapter_product_s_gradients_equal_finite_differences(spans):
    from inverted.train.lora import _AddLowRank

    g = torch.Generator().manual_seed(0)
    out, low = torch.randn(4, 10, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
    bs = [torch.randn(len(range(10)[w]), len(range(6)[r]), generator=g, dtype=torch.float64) for r, w in spans]
    inputs = [t.requires_grad_() for t in (out, low, *bs)]
    expected = out.clone()
    for (reads, writes), b in zip(spans, bs):
        expected[:, writes] += low[:, reads] @ b.t()
    torch.testing.assert_close(_AddLowRank.apply(out, low, spans, *bs), expected)
    assert torch.autograd.gradcheck(lambda o, low, *b: _AddLowRank.apply(o, low, spans, *b), inputs)


@pytest.mark.slow  # several ranks: left out of make test-fast
def test_lora_tp2_equals_tp1(lora_runs):
    _, _, run, _ = lora_runs
    results = {tp: run(tp) for tp in (1, 2)}
    torch.testing.assert_close(results[2]["before"]["logits"], results[1]["before"]["logits"], rtol=0, atol=1e-5)
    torch.testing.assert_close(results[2]["after"]["logits"], results[1]["after"]["logits"], rtol=0, atol=1e-5)
    for name in ("train/loss", "train/pg_loss", "train/kl", "train/grad_norm"):
        assert results[2]["metrics"][name] == pytest.approx(results[1]["metrics"][name], rel=1e-5, abs=1e-7), name
    for name, tensor in results[1]["after"]["adapter"].items():
        torch.testing.assert_close(results[2]["after"]["adapter"][name], tensor, rtol=0, atol=1e-6)


@pytest.mark.slow  # several ranks: left out of make test-fast
def test_lora_pp2_dp2_equals_one_process_and_exports(tiny_model, tmp_path):
    """Four gloo ranks, two pipeline stages of two data-parallel replicas, train the adapter as one
    process does: two optimizer steps through the 1F1B schedule, from a PEFT adapter, with the KL to
    the base model (the adapters off). Log-probs, metrics, the untouched base and the adapter
    (assembled on the first stage) must match, and the four-rank checkpoint must export as exactly
    that adapter."""
    from tests.train.workers import check_same_training, logprobs_step_and_save

    path = str(tiny_model("qwen3"))
    adapter = peft_adapter(path, tmp_path / "start")  # every module, B random: the KL is well above roundoff
    samples = make_samples(seed=7)
    results = {}
    for pp, dp in ((1, 1), (2, 2)):
        cfg = from_flags(
            TrainConfig,
            hf_checkpoint=path,
            lr=1e-2,
            adam_eps=1.0,
            pipeline_model_parallel_size=pp,
            actor_num_gpus_per_node=pp * dp,
            max_tokens_per_gpu=24,
            global_batch_size=4,
            lora_adapter_path=str(adapter),
            use_kl_loss=True,
            kl_loss_coef=0.1,
        )
        spawn(logprobs_step_and_save, pp * dp, cfg, samples, str(tmp_path / f"ckpt{pp}"), str(tmp_path / f"{pp}.pt"))
        results[pp] = torch.load(tmp_path / f"{pp}.pt")
    one, four = results[1], results[2]
    assert one["metrics"]["train/optimizer_steps"] == 2 and one["metrics"]["train/kl"] > 0
    assert len(one["adapter"]) == 2 * 7 * 2  # A and B of all seven modules in both layers
    check_same_training(
        one,
        four,
        tmp_path / "ckpt2",
        tmp_path / "peft",
        ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm", "train/loss_tokens"),
    )


@pytest.mark.slow  # a whole job: left out of make test-fast
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # its own output layer; one tied to the embedding
def test_lora_resume_equals_the_uninterrupted_run_and_exports_an_adapter_or_a_merged_model(arch, tiny_model, tmp_path):
    """2 rollouts straight == 1, save (the adapter only), resume, 1 more; the checkpoint exports as a PEFT
    adapter that peft loads, and merged (--merge-lora) as a model that transformers loads: the same logits.
    The output layer is adapted too: merged into a tied model, it becomes a weight of its own."""
    from tests.train.samples import write_jsonl
    from tests.train.test_trainer import check_resume_equals_straight, train_cli

    base = tiny_model(arch)
    data = tmp_path / "rollout_{rollout_id}.jsonl"
    for rollout in range(2):
        write_jsonl(make_samples(seed=rollout), str(data).format(rollout_id=rollout))
    common = [
        "--hf-checkpoint",
        str(base),
        "--load-debug-rollout-data",
        str(data),
        "--lr",
        "1e-2",
        "--global-batch-size",
        "4",
        "--max-tokens-per-gpu",
        "64",
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--target-modules",
        "q_proj",
        "o_proj",
        "gate_proj",
        "lm_head",
    ]
    check_resume_equals_straight(common, 2, 1, tmp_path)
    saved = torch.load(next((tmp_path / "ckpt").glob("iter_*2/rank_0_0_0.pt")), weights_only=True)["model"]
    assert saved and all(".lora." in name for name in saved)  # the frozen base is not saved again
    assert any("output_layer.lora." in name for name in saved)
    wrong = train_cli(
        *common[:-3], "--num-rollout", "3", "--output-dir", str(tmp_path / "d"), "--load", str(tmp_path / "ckpt")
    )
    assert wrong.returncode == 2 and "saved with LoRA" in wrong.stderr

    import subprocess
    import sys

    def export(*extra: str) -> str:
        out = tmp_path / ("merged" if extra else "adapter")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "inverted.cli",
                "export-hf",
                "--checkpoint",
                str(tmp_path / "ckpt"),
                "--out",
                str(out),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return out

    tokens = make_samples(seed=3)[0].tokens
    with torch.no_grad():
        with_adapter = peft_logits(base, export())(tokens)
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(
            torch.tensor([tokens])
        ).logits[0]
        merged = transformers.AutoModelForCausalLM.from_pretrained(export("--merge-lora"), dtype=torch.float32)
        torch.testing.assert_close(merged(torch.tensor([tokens])).logits[0], with_adapter, rtol=0, atol=1e-4)
    assert (with_adapter - plain).abs().max() > 1e-4  # the trained adapter does change the model


@pytest.mark.parametrize(
    "transport, tp", [("tensor", 1), ("disk", 1), pytest.param("tensor", 2, marks=pytest.mark.slow)]
)  # two ranks: slow
def test_after_a_step_and_an_adapter_sync_the_engine_scores_tokens_as_the_trainer_does(
    procs, tiny_model, tmp_path, transport, tp
):
    """The server holds the trained adapter under POLICY_ADAPTER after the sync, which moved the adapter's
    bytes only; the base model is still served beside it."""
    import httpx

    from inverted.hf_checkpoint import ModelSpec
    from inverted.peft_adapter import module_shapes
    from inverted.types import POLICY_ADAPTER
    from tests.train.workers import step_and_sync

    path = tiny_model("qwen2")
    engine = procs.engine(path, "--enable-lora", "--max-lora-rank", "8").url
    probe = [5, 17, 230, 41, 9, 600, 77, 3, 1000, 12, 64, 8]
    cfg = from_flags(
        TrainConfig,
        hf_checkpoint=str(path),
        lr=1e-2,
        update_weight_transport=transport,
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=tp,
        lora_rank=8,
        lora_alpha=16,
        pause_mode="in_place",
        output_dir=str(tmp_path),
    )
    spawn(step_and_sync, tp, cfg, make_samples(seed=2), [engine], probe, str(tmp_path / "out.pt"))
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    report, spec = out["report"], ModelSpec.from_checkpoint(path)
    assert report.transport == transport and report.buckets == 1
    assert report.bytes == spec.num_layers * sum(8 * (o + i) * 4 for o, i in module_shapes(spec).values())  # fp32, r=8

    def logprobs(**extra) -> tuple[torch.Tensor, str]:
        meta = httpx.post(
            engine + "/generate",
            timeout=60,
            json={
                "input_ids": probe,
                "return_logprob": True,
                "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1},
                **extra,
            },
        ).json()["meta_info"]
        return torch.tensor([entry[0] for entry in meta["input_token_logprobs"][1:]]), meta["weight_version"]

    adapted, version = logprobs(lora_path=POLICY_ADAPTER)
    assert version == "1" and (adapted - out["logprobs"]).abs().max() <= 1e-4
    assert (logprobs()[0] - out["logprobs"]).abs().max() > 1e-3, "the step moved the adapter away from the base"
