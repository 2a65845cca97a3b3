"""The trainer end to end: data parallelism, resume, learning direction, bad input, and export."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from inverted.config import from_flags
from inverted.train.config import TrainConfig
from inverted.train.parallel import spawn
from inverted.types import Sample
from tests.train.samples import make_samples, write_jsonl
from tests.train.workers import (
    check_same_training,
    grpo_step,
    logits_and_step,
    logprobs_step_and_save,
    step_at_version,
    step_save_and_finish,
)


@pytest.mark.slow  # several ranks: left out of make test-fast
def test_dp2_equals_one_process_on_the_whole_batch(tiny_model, tmp_path):
    path = str(tiny_model("qwen2"))
    results = {}
    for ranks in (1, 2):
        cfg = from_flags(
            TrainConfig, hf_checkpoint=path, lr=1e-2, adam_eps=1.0, actor_num_gpus_per_node=ranks, max_tokens_per_gpu=24
        )
        spawn(logits_and_step, ranks, cfg, str(tmp_path / f"dp{ranks}.pt"))
        results[ranks] = torch.load(tmp_path / f"dp{ranks}.pt")
    for name in ("train/loss", "train/entropy", "train/grad_norm", "train/loss_tokens"):
        assert results[2]["metrics"][name] == pytest.approx(results[1]["metrics"][name], rel=1e-5), name
    for name, tensor in results[1]["weights"].items():
        torch.testing.assert_close(results[2]["weights"][name], tensor, rtol=0, atol=1e-7)


@pytest.mark.slow  # several ranks: left out of make test-fast
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_pp2_equals_one_process_and_exports(sequence_parallel, tiny_model, tmp_path):
    """Four gloo ranks, two pipeline stages of two tensor-parallel ranks each, give one process's result,
    with or without sequence parallelism (the ranks split each row outside attention; their norms'
    gradients are summed).

    Two optimizer steps of several micro-batches each run Megatron's 1F1B schedule (warm-up,
    steady state, cool-down), with a no-grad pass for the old log-probs and one through the frozen
    reference; Qwen3 ties its embeddings, so the last stage trains its own copy of them. Log-probs,
    metrics and the updated weights (assembled on the first stage) must match, and the
    four-rank checkpoint must export to exactly those weights.
    """
    path = str(tiny_model("qwen3"))
    samples = make_samples(seed=7)
    results = {}
    for tp, pp in ((1, 1), (2, 2)):
        cfg = from_flags(
            TrainConfig,
            hf_checkpoint=path,
            lr=1e-2,
            adam_eps=1.0,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            actor_num_gpus_per_node=tp * pp,
            max_tokens_per_gpu=24,
            global_batch_size=4,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            sequence_parallel=sequence_parallel and tp > 1,
            output_dir=str(tmp_path / f"out{pp}"),
        )
        spawn(logprobs_step_and_save, tp * pp, cfg, samples, str(tmp_path / f"ckpt{pp}"), str(tmp_path / f"{pp}.pt"))
        results[pp] = torch.load(tmp_path / f"{pp}.pt")
    one, four = results[1], results[2]
    assert len(one["logprobs"]) == len(samples) == len(four["logprobs"])
    assert one["metrics"]["train/optimizer_steps"] == 2 and one["metrics"]["train/kl"] > 0
    check_same_training(
        one,
        four,
        tmp_path / "ckpt2",
        tmp_path / "hf",
        ("train/loss", "train/pg_loss", "train/kl", "train/entropy", "train/grad_norm", "train/loss_tokens"),
    )
    check_details(samples, one["logprobs"], [tmp_path / "out1", tmp_path / "out2"])


def check_details(samples: list[Sample], logprobs: dict[int, torch.Tensor], run_dirs) -> None:
    """``train_details.db``: per Sample, the log-probs of the policy that took the step (as the
    schedule's no-grad pass computed them before it), the same from every layout, and advantages
    that follow the reward against its group's mean."""
    from inverted.train.details import DetailsReader

    for run_dir in run_dirs:
        reader = DetailsReader(run_dir)
        assert len(reader.summaries()) == len(samples)
        for i, sample in enumerate(samples):
            detail = reader.get(sample.group_index, sample.index, 0)
            assert detail.step == 0
            torch.testing.assert_close(
                torch.from_numpy(detail.log_probs.copy()), logprobs[i].float(), rtol=0, atol=1e-5
            )
            group = [s.reward for s in samples if s.group_index == sample.group_index]
            centred = sample.reward - sum(group) / len(group)
            assert (detail.advantages == detail.advantages[0]).all()
            assert (
                detail.advantages[0] == pytest.approx(0.0, abs=1e-6)
                if centred == 0
                else (detail.advantages[0] > 0) == (centred > 0)
            )
            on = torch.tensor(sample.loss_mask, dtype=torch.bool)
            rollout = torch.tensor(sample.rollout_log_probs)
            assert detail.mismatch == pytest.approx(float((logprobs[i].float() - rollout)[on].abs().mean()), abs=1e-5)


def test_grpo_step_raises_the_rewarded_answer(tiny_model, tmp_path):
    samples = make_samples(seed=3, groups=1, per_group=4)
    for i, sample in enumerate(samples):
        sample.reward = 1.0 if i == 2 else 0.0
        sample.loss_mask = [1] * sample.response_length
    cfg = from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), lr=1e-3, output_dir=str(tmp_path / "out"))
    spawn(grpo_step, 1, cfg, samples, str(tmp_path / "grpo.pt"))
    result = torch.load(tmp_path / "grpo.pt")
    check_details(samples, result["before"], [tmp_path / "out"])  # one optimizer step: the loss's own log-probs
    gain = {i: float(result["after"][i].sum() - result["before"][i].sum()) for i in range(4)}
    assert gain[2] > 0.01, gain
    assert all(gain[i] < 0 for i in (0, 1, 3)), gain


def test_per_token_versions_reach_the_loss(tiny_model, tmp_path):
    """Partial rollouts: tokens sampled by versions 1 and 2, trained by a policy at version 2.

    ``--mask-offpolicy-in-partial-rollout`` must equal zeroing, by hand, the loss mask of every token
    older than its sample's newest (exactly the same update); staleness is reported per token."""
    samples = make_samples(seed=5)
    for sample in samples:
        old = sample.response_length // 2
        sample.weight_versions = ["1"] * old + ["2"] * (sample.response_length - old)
    by_hand = [Sample.from_json(s.to_json()) for s in samples]
    for sample in by_hand:
        sample.loss_mask = [m if v == "2" else 0 for m, v in zip(sample.loss_mask, sample.weight_versions)]
    path = str(tiny_model("qwen2"))
    masked_cfg = from_flags(TrainConfig, hf_checkpoint=path, lr=1e-2, mask_offpolicy_in_partial_rollout=True)
    spawn(step_at_version, 1, masked_cfg, samples, 2, str(tmp_path / "masked.pt"))
    spawn(
        step_at_version,
        1,
        from_flags(TrainConfig, hf_checkpoint=path, lr=1e-2),
        by_hand,
        2,
        str(tmp_path / "by_hand.pt"),
    )
    spawn(
        step_at_version, 1, from_flags(TrainConfig, hf_checkpoint=path, lr=1e-2), samples, 2, str(tmp_path / "all.pt")
    )
    masked, manual, unmasked = (torch.load(tmp_path / f"{name}.pt") for name in ("masked", "by_hand", "all"))

    for name, tensor in manual["weights"].items():
        torch.testing.assert_close(masked["weights"][name], tensor, rtol=0, atol=0)
    assert any(not torch.equal(unmasked["weights"][n], t) for n, t in manual["weights"].items())  # masking mattered
    dropped = sum(s.loss_mask.count(1) for s in samples) - sum(s.loss_mask.count(1) for s in by_hand)
    assert dropped > 0 and masked["metrics"]["train/offpolicy_masked_tokens"] == dropped
    assert masked["metrics"]["train/token_staleness"] == 0.0  # only version-2 tokens are left in the loss
    stale = [2 - int(v) for s in samples for m, v in zip(s.loss_mask, s.weight_versions) if m]
    assert unmasked["metrics"]["train/token_staleness"] == pytest.approx(sum(stale) / len(stale))
    assert unmasked["metrics"]["train/token_staleness_max"] == 1.0


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "inverted.cli", "train", "--debug-train-only", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_resume_equals_straight(common: list[str], total: int, stop: int, root) -> list[dict]:
    """``total`` rollouts straight against ``stop``, a save (``root/ckpt``) and a resume to ``total``:
    every step's metrics are equal (timings aside). The straight run's metrics rows."""
    ckpt = str(root / "ckpt")
    for args in (
        ["--num-rollout", str(total), "--output-dir", str(root / "a")],
        ["--num-rollout", str(stop), "--output-dir", str(root / "b"), "--save", ckpt],
        ["--num-rollout", str(total), "--output-dir", str(root / "c"), "--load", ckpt, "--save", ckpt],
    ):
        done = train_cli(*common, *args)
        assert done.returncode == 0, done.stderr
    a, bc = metrics(root / "a"), metrics(root / "b") + metrics(root / "c")
    assert [row["step"] for row in bc] == list(range(total))
    for want, got in zip(a, bc, strict=True):
        for name, value in want.items():
            if not name.startswith("perf/"):
                assert got[name] == value, (want["step"], name)
    return a


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_resume_reproduces_the_uninterrupted_run_and_exports(tiny_model, tmp_path):
    """3 rollouts, save, resume, 2 more == 5 rollouts straight; the checkpoint exports to HF."""
    data = tmp_path / "rollout_{rollout_id}.jsonl"
    for rollout in range(5):
        write_jsonl(make_samples(seed=rollout), str(data).format(rollout_id=rollout))
    template = tmp_path / "run.jinja"  # the run's --chat-template travels with its checkpoints
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    common = [
        "--hf-checkpoint",
        str(tiny_model("qwen2")),
        "--load-debug-rollout-data",
        str(data),
        "--lr",
        "1e-3",
        "--global-batch-size",
        "4",
        "--max-tokens-per-gpu",
        "32",
        "--chat-template",
        str(template),
    ]
    a = check_resume_equals_straight(common, 5, 3, tmp_path)
    assert a[-1]["train/loss"] != a[0]["train/loss"]

    exported = tmp_path / "hf"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "export-hf",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--out",
            str(exported),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    trained = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(tiny_model("qwen2"), dtype=torch.float32)
    trained_sd, original_sd = trained.state_dict(), original.state_dict()
    assert trained_sd.keys() == original_sd.keys()
    assert any(not torch.equal(trained_sd[k], original_sd[k]) for k in original_sd)
    # the tokenizer travels with the checkpoint, with the template the run rendered with
    assert transformers.AutoTokenizer.from_pretrained(exported).chat_template == template.read_text()

    other = train_cli(
        "--hf-checkpoint",
        str(tiny_model("llama")),
        "--load-debug-rollout-data",
        str(data),
        "--num-rollout",
        "6",
        "--output-dir",
        str(tmp_path / "d"),
        "--load",
        str(tmp_path / "ckpt"),
    )
    assert other.returncode == 2
    assert "checkpoint of another model than --hf-checkpoint" in other.stderr
    assert not (tmp_path / "d" / "metrics.jsonl").read_text()


def test_the_final_export_runs_after_the_trainer_has_let_go_of_its_state(tiny_model, tmp_path):
    """The job's last trainer call (``finish``): every parameter and Adam moment is freed before the
    export starts, so the export's working set never sits beside the training state (the whole job's
    peak memory, docs/performance-history.md), and the export holds the trained weights exactly."""
    cfg = from_flags(TrainConfig, hf_checkpoint=str(tiny_model("qwen2")), lr=1e-2, output_dir=str(tmp_path))
    spawn(
        step_save_and_finish,
        1,
        cfg,
        make_samples(seed=3),
        str(tmp_path / "ckpt"),
        str(tmp_path / "hf"),
        str(tmp_path / "out.pt"),
    )
    result = torch.load(tmp_path / "out.pt", weights_only=False)
    assert result["tracked"] > 20 and result["alive_at_export"] == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(result["path"], dtype=torch.float32).state_dict()
    for name, tensor in result["weights"].items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda s: s.loss_mask.pop(), "loss_mask: expected a list of"),
        (lambda s: setattr(s, "reward", float("nan")), "reward"),
        (lambda s: setattr(s, "status", Sample.Status.FAILED), "status 'failed' is not trainable"),
        (lambda s: s.tokens.__setitem__(0, 99999), "outside the vocabulary"),
    ],
)
def test_bad_samples_are_refused_before_any_process_starts(breakage, message, tiny_model, tmp_path):
    samples = make_samples(seed=0)
    breakage(samples[5])
    write_jsonl(samples, tmp_path / "data.jsonl")
    done = train_cli(
        "--hf-checkpoint",
        str(tiny_model("qwen2")),
        "--load-debug-rollout-data",
        str(tmp_path / "data.jsonl"),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert done.returncode == 2, done.stderr
    # The one line of the refusal: no trainer process started, no model was built (Megatron logs on import).
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("inverted train: error: sample 5 ") and message in line
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    assert not metrics_file.exists() or not metrics_file.read_text()
