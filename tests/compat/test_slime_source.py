"""slime's own files, read from its source (``SLIME_SOURCE``: a checkout of THUDM/slime), run here as
its users run them: copied into their tree, or named by path.

- ``slime/rollout/sft_rollout.py`` copied into a user's tree trains: its Samples sampled nothing
  (no rollout log-probs, no weight versions), which slime's contract allows;
- ``examples/train_infer_mismatch_helper/mis.py``, the TIS function slime's customization guide
  names, runs on ``slime.backends.megatron_utils.cp_utils`` (context parallel of size 1), alone and
  as ``--custom-tis-function-path`` in a training step;
- ``slime/rollout/rm_hub/math_utils.py``, slime's rule-based math grader, imports ``pylatexenc``
  (the ``slime`` install extra) and grades.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

from envs.datasets import write_dataset
from inverted.types import Sample
from tests.compat.test_slime_training import one_step
from tests.job.test_train_job import check, inverted, metrics_rows
from tests.train.samples import make_samples

SOURCE = Path(os.environ.get("SLIME_SOURCE", "/nonexistent"))
pytestmark = pytest.mark.skipif(
    not (SOURCE / "slime").is_dir(), reason="slime's source is not at hand (SLIME_SOURCE=checkout)"
)
MIS = SOURCE / "examples" / "train_infer_mismatch_helper"


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def conversations(count: int, rng=None) -> list[dict]:
    return [
        {
            "input": [
                {"role": "user", "content": f"What is {i} + 1?"},
                {"role": "assistant", "content": f"It is {i + 1}."},
            ]
        }
        for i in range(count)
    ]


@pytest.mark.slow  # a whole job: left out of make test-fast
def test_slimes_sft_rollout_copied_into_a_users_tree_trains(tiny_model, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    shutil.copy(SOURCE / "slime" / "rollout" / "sft_rollout.py", tree / "my_sft.py")
    prompts = write_dataset(conversations, tmp_path / "sft.jsonl", 4)
    data, run_dir = tmp_path / "rollout_{rollout_id}.jsonl", tmp_path / "run"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model("qwen2")),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            "my_sft.generate_rollout",
            "--loss-mask-type",
            "qwen",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "1",
            "--num-engines",
            "1",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            "--log-level",
            "warning",
            pythonpath=tree,
        )
    )
    trained = [m for m in metrics_rows(run_dir) if "train/loss" in m]
    assert [m["train/samples_without_rollout_logprobs"] for m in trained] == [2.0, 2.0]
    for rollout_id, version in ((0, "default"), (1, "1")):
        for line in (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines():
            sample = Sample.from_json(json.loads(line))
            assert sample.rollout_log_probs is None and sample.weight_versions == [version] * sample.response_length
            assert sample.prompt_length > 0 and set(sample.loss_mask) == {1}  # the response: the assistant's words


def test_slimes_mis_function_runs_on_cp_utils_at_context_parallel_one():
    """At CP 1 ``compute_mis_weights_with_cp`` is ``compute_mis_weights`` (slime's own, in the same file)
    applied to the policy-gradient loss: gathering and slicing change nothing."""
    from inverted.compat.slime import SlimeArgs

    mis = load_file(MIS / "mis.py", "slime_mis")
    args = SlimeArgs.of(yaml.safe_load((MIS / "mis.yaml").read_text()))
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 5, 2]
    train = [-torch.rand(n, generator=generator) * 2 for n in lengths]
    rollout = [t + 0.3 * torch.randn(n, generator=generator) for t, n in zip(train, lengths)]
    masks = [torch.tensor([1, 0, 1][:n] + [1] * (n - 3), dtype=torch.float32) for n in lengths]
    pg = torch.randn(sum(lengths), generator=generator)
    out, out_masks, metrics = mis.compute_mis_weights_with_cp(
        args,
        pg_loss=pg,
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=masks,
        total_lengths=[n + 4 for n in lengths],
        response_lengths=lengths,
    )
    weights, expected_masks, _ = mis.compute_mis_weights(
        args, train_log_probs=train, rollout_log_probs=rollout, loss_masks=masks
    )
    assert torch.equal(out, pg * torch.cat(weights))
    assert all(torch.equal(a, b) for a, b in zip(out_masks, expected_masks))
    assert metrics and all(v.shape == (sum(lengths),) for v in metrics.values())


def test_slimes_mis_function_is_a_tis_plugin(tiny_model, tmp_path, monkeypatch):
    """``--custom-tis-function-path mis.compute_mis_weights_with_cp`` with its ``mis.yaml`` as slime's
    custom config: one training step through the loader, the loss from the function's weights."""
    monkeypatch.syspath_prepend(str(MIS))
    config = yaml.safe_load((MIS / "mis.yaml").read_text())
    samples = make_samples(seed=5)
    metrics = one_step(
        tiny_model,
        tmp_path,
        samples,
        custom_tis_function_path="mis.compute_mis_weights_with_cp",
        plugin_args=json.dumps(config),
    )
    assert torch.isfinite(torch.tensor([metrics["train/loss"], metrics["train/pg_loss"]])).all()
    plain = one_step(tiny_model, tmp_path, samples)
    assert metrics["train/pg_loss"] != pytest.approx(plain["train/pg_loss"])  # the weights took effect


def test_slimes_math_grader_imports_pylatexenc_and_grades(tmp_path, monkeypatch):
    """``rm_hub/math_utils.py`` copied into a user's tree: it imports ``pylatexenc`` (the ``slime`` extra)."""
    shutil.copy(SOURCE / "slime" / "rollout" / "rm_hub" / "math_utils.py", tmp_path / "my_math_utils.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_math_utils", None)
    import my_math_utils

    assert my_math_utils.grade_answer_verl("so the answer is \\boxed{\\frac{1}{2}}", "0.5")
    assert my_math_utils.grade_answer_verl("\\boxed{2\\pi}", "2*pi")  # LaTeX read by pylatexenc
    assert not my_math_utils.grade_answer_verl("\\boxed{3}", "2")
