"""slime plug-ins in a real job (`inverted train`, engines behind sgl-router, the buffer service): a
custom generate function's multi-turn tool loop, a batched group reward model, a buffer filter, a
sample filter, evaluation by another rollout function, and slime's logging hooks."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from envs.calculator import rows as calculator_rows
from envs.datasets import write_dataset
from inverted.train.details import DetailsReader
from inverted.types import Sample
from tests.job.test_train_job import ONE_ENGINE_RUN, SMALL_RUN, check, inverted, metrics_rows, stored_samples

pytestmark = pytest.mark.slow  # whole jobs: left out of make test-fast

PLUGINS = "tests.compat.slime_plugins"


def test_a_slime_custom_generate_job(tiny_model, tmp_path, monkeypatch):
    log = tmp_path / "slime_log.jsonl"
    monkeypatch.setenv("SLIME_PLUGIN_LOG", str(log))
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    data, run_dir = tmp_path / "rollout_{rollout_id}.jsonl", tmp_path / "run"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--custom-generate-function-path",
            f"{PLUGINS}:generate",
            "--custom-rm-path",
            f"{PLUGINS}:group_rm",
            "--group-rm",
            "--buffer-filter-path",
            f"{PLUGINS}.newest_groups_first",
            "--rollout-sample-filter-path",
            f"{PLUGINS}:remove_odd_indices",
            "--custom-rollout-log-function-path",
            f"{PLUGINS}:log_rollout",
            "--eval-interval",
            "1",
            "--eval-prompt-data",
            str(prompts),
            "--eval-function-path",
            f"{PLUGINS}:eval_rollout",
            "--custom-eval-rollout-log-function-path",
            f"{PLUGINS}:log_eval",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *SMALL_RUN,
        )
    )

    for rollout_id in range(2):
        saved = [
            Sample.from_json(json.loads(line))
            for line in (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines()
        ]
        assert len(saved) == 4
        groups = [s.group_index for s in saved]
        assert groups == sorted(groups, reverse=True)  # the buffer filter's order, not the oldest first
        for sample in saved:
            sample.validate()
            mask = sample.loss_mask
            # two model turns around the calculator's answer: sampled, masked tool output, sampled
            assert mask[0] == 1 and mask[-1] == 1 and 0 in mask and mask.index(0) > 0
            assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, mask) if not m)
            # every token, from the router's answers (the servers' initial version in a rollout-only job)
            assert sample.weight_versions == ["default"] * sample.response_length
            assert sample.remove_sample == (sample.index % 2 == 1)
        for group in {s.group_index for s in saved}:
            members = [s for s in saved if s.group_index == group]
            longest = max(s.response_length for s in members)
            assert [s.reward for s in members] == [float(s.response_length == longest) for s in members]

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    rollouts = [line for line in lines if "rollout_id" in line]
    assert [r["rollout_id"] for r in rollouts] == [0, 1] and all(
        r["samples"] == 4 and r["removed"] == 2 for r in rollouts
    )
    assert [line["eval"] for line in lines if "eval" in line] == [0, 1, 2]
    rows = metrics_rows(run_dir)
    assert all("rollout/reward_mean" not in row for row in rows)  # the log function took it over
    assert [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row] == [0.5, 0.5, 0.5]


def test_slime_flags_we_do_not_have_and_wrong_plugins_fail_before_anything_starts(tiny_model, tmp_path):
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 2)
    base = [
        "train",
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(prompts),
        "--output-dir",
        str(tmp_path / "run"),
    ]
    for args, message in [
        (
            ["--data-source-path", "x:y"],
            "--data-source-path='x:y' is a slime flag inverted does not have: inverted's Data Buffer",
        ),
        (["--num-layers", "5"], "slime's model flags do not describe --hf-checkpoint: --num-layers 5 != 2"),
        (
            ["--sglang-config", "/nonexistent.yaml"],
            "--sglang-config='/nonexistent.yaml': inverted starts --num-engines",
        ),
        (
            ["--custom-generate-function-path", f"{PLUGINS}:group_rm"],
            "does not match slime's def group_rm(args, sample, sampling_params)",
        ),
        (
            [
                "--custom-generate-function-path",
                f"{PLUGINS}:generate",
                "--rollout-function-path",
                "rollout_functions.subprocess_agent:generate_rollout",
            ],
            "runs inside rollout_functions.single_turn:generate_rollout (slime's default rollout), not inside",
        ),
        (
            [
                "--custom-generate-function-path",
                f"{PLUGINS}:generate",
                "--loss-type",
                "custom_loss",
                "--custom-loss-function-path",
                f"{PLUGINS}:log_rollout",
            ],
            "does not match slime's def log_rollout(args, batch, logits, sum_of_sample_mean)",
        ),
        (
            ["--custom-generate-function-path", f"{PLUGINS}:generate", "--loss-type", "custom_loss"],
            "--custom-loss-function-path=None: expected a module:function with --loss-type custom_loss",
        ),
        (
            ["--custom-generate-function-path", f"{PLUGINS}:generate", "--buffer-filter-path", f"{PLUGINS}:no_such"],
            "--buffer-filter-path='tests.compat.slime_plugins:no_such': cannot load it",
        ),
        (
            [
                "--custom-generate-function-path",
                f"{PLUGINS}:generate",
                "--custom-tis-function-path",
                f"{PLUGINS}:group_rm",
            ],
            "--custom-tis-function-path='tests.compat.slime_plugins:group_rm': signature (args, samples: "
            "list[inverted.compat.slime.Sample]) -> list[float] does not match slime's def group_rm(args, *, pg_loss",
        ),
    ]:
        result = inverted(*base, *args, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr[-3000:])
        assert not (tmp_path / "run" / "buffer.db").exists()


def test_plugins_in_slimes_current_style_run_unchanged(tiny_model, tmp_path):
    """August 2026's slime: a rollout function answering ``RolloutFnTrainOutput``, whose generate
    function grows each Sample with ``append_response_tokens`` and rewards it with a dict of any JSON
    values; slime's own ``check_reward_nonzero_std`` filter, by its module path, reading ``--reward-key``,
    and the batch it thinned refilled by a second round of sampling (``--max-sampling-rounds``), as
    slime's dynamic sampling refills it; at the end of the data, what the rounds found is served."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 6)
    data = tmp_path / "rollout_{rollout_id}.jsonl"
    custom = tmp_path / "custom.yaml"
    custom.write_text(f"args_log: {tmp_path / 'args'}\nmax_turns: 2\n")
    slime_launch = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--swiglu",
        "--use-wandb",
        "--wandb-project",
        "p",
        "--sglang-mem-fraction-static",
        "0.7",
        "--custom-config-path",
        str(custom),
    ]
    result = inverted(
        "train",
        "--debug-rollout-only",
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(prompts),
        "--rollout-function-path",
        f"{PLUGINS}.rollout_noting_args",
        "--reward-key",
        "score",
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--buffer-filter-path",
        f"{PLUGINS}:oldest_first_noting_args",
        "--save-debug-rollout-data",
        str(data),
        "--output-dir",
        str(tmp_path / "run"),
        "--num-rollout",
        "2",
        "--num-epoch",
        "1",
        "--max-sampling-rounds",
        "3",
        *SMALL_RUN,
        *slime_launch,
    )
    check(result)
    # slime's args is one namespace, the same in the rollout function's process and the buffer service's
    noted = json.loads((tmp_path / "args.rollout").read_text())
    assert noted == json.loads((tmp_path / "args.buffer").read_text())
    assert noted == {
        "num_layers": 2,
        "use_wandb": True,
        "wandb_project": "p",
        "sglang_mem_fraction_static": 0.7,
        "max_turns": 2,
        "reward_key": "score",
        "rollout_batch_size": 2,
        "calculate_per_token_loss": False,
        "use_rollout_logprobs": False,
        "rm_type": None,
    }
    for line in (
        "slime flags accepted with no effect here",
        "--use-wandb=True: metrics go to",
        "--sglang-mem-fraction-static=0.7: a setting of real SGLang",
    ):
        assert line in result.stderr
    saved = [Sample.from_json(json.loads(line)) for line in (tmp_path / "rollout_0.jsonl").read_text().splitlines()]
    assert saved
    for sample in saved:
        sample.validate()
        mask = sample.loss_mask
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1  # sampled, the tool's answer (trainable=False), sampled
        assert all(lp == 0.0 for lp, m in zip(sample.rollout_log_probs, mask) if not m)
        assert sample.weight_versions == ["default"] * sample.response_length  # from each call's meta_info
        assert set(sample.reward) == {"score", "parsed"} and isinstance(sample.reward["parsed"], str)
        assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    for group in {s.group_index for s in saved}:  # the filter let through only groups whose scores differ
        assert group % 2 and len({s.reward["score"] for s in saved if s.group_index == group}) > 1
    # Each round of 2 prompts gives one group the filter keeps: the batch of 2 is full after the second round,
    # and the third is never sampled.
    assert {s.group_index for s in saved} == {1, 3}, sorted({s.group_index for s in saved})
    first, second = [r for r in metrics_rows(tmp_path / "run") if "rollout/samples" in r]
    assert (
        first["rollout/sampling_rounds"] == 2
        and first["rollout/samples"] == 8
        and first["rollout/trained_samples"] == 4
    )
    # The second step's first round leases the last 2 prompts (one kept group); its second finds the data at an
    # end (--num-epoch 1) and the step takes the one group it has instead of failing or waiting.
    last = [Sample.from_json(json.loads(line)) for line in (tmp_path / "rollout_1.jsonl").read_text().splitlines()]
    assert {s.group_index for s in last} == {5}, sorted({s.group_index for s in last})
    assert (
        second["rollout/sampling_rounds"] == 2
        and second["rollout/samples"] == 4
        and second["rollout/trained_samples"] == 2
    )


def test_a_plugins_exception_in_the_buffer_reaches_the_console_with_its_traceback(tiny_model, tmp_path):
    """It was a bare ``status=500`` in the job, the traceback only in the buffer service's log."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    result = inverted(
        "train",
        "--debug-rollout-only",
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(prompts),
        "--custom-generate-function-path",
        f"{PLUGINS}:generate",
        "--dynamic-sampling-filter-path",
        f"{PLUGINS}:broken_filter",
        "--output-dir",
        str(tmp_path / "run"),
        "--num-rollout",
        "1",
        *SMALL_RUN,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("inverted train: error:") :]
    assert (
        "in the Data Buffer service: --dynamic-sampling-filter-path='tests.compat.slime_plugins:broken_filter' "
        "raised TypeError: 'NoneType' object is not subscriptable"
    ) in error, error
    assert 'slime_plugins.py", line' in error and "in broken_filter" in error and "no_such_key" in error


def check_distilled(run_dir: Path, teacher: Path, coef: float, task_reward: bool) -> None:
    """Each trained token's advantage is its task advantage (the raw reward, or none) minus ``coef`` x
    (the trainer's log-prob - the teacher's), the teacher's from ``transformers``."""
    model = AutoModelForCausalLM.from_pretrained(teacher, torch_dtype=torch.float32)
    reader = DetailsReader(run_dir)
    checked = 0
    for (group, index), sample in stored_samples(run_dir).items():
        detail = reader.get(group, index, 0)
        if detail is None:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([sample.tokens])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
        reference = logp[-sample.response_length :]
        base = sample.reward if task_reward else 0.0
        expected = base - coef * (torch.from_numpy(detail.log_probs.copy()) - reference)
        assert torch.allclose(torch.from_numpy(detail.advantages.copy()), expected, atol=2e-3), (group, index)
        checked += 1
    assert checked == 4


def test_on_policy_distillation_from_a_teacher_server(tiny_model, procs, tmp_path):
    """slime's OPD with ``--opd-type sglang``: the reward model asks a teacher server for the
    sequence's log-probs and the post-process puts them on the Samples (plug-ins in the shape of
    slime's ``on_policy_distillation``); the trainer's advantages follow them exactly."""
    student, teacher = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    server = procs.engine(teacher, name="teacher")
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    run_dir, coef = tmp_path / "run", 0.5
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(student),
            "--prompt-data",
            str(prompts),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "1",
            "--save-train-details",
            "--rollout-function-path",
            "rollout_functions.single_turn:generate_rollout",
            "--custom-rm-path",
            f"{PLUGINS}.teacher_answer",
            "--custom-reward-post-process-path",
            f"{PLUGINS}.teacher_log_probs",
            "--use-opd",
            "--opd-type",
            "sglang",
            "--opd-kl-coef",
            str(coef),
            "--rm-url",
            f"{server.url}/generate",
            *SMALL_RUN,
        )
    )
    check_distilled(run_dir, teacher, coef, task_reward=False)
    assert "train/opd_reverse_kl" in metrics_rows(run_dir)[0]


def test_on_policy_distillation_with_the_teacher_in_the_trainer(tiny_model, tmp_path):
    """``--opd-type megatron``: the trainer runs the teacher (``--opd-teacher-load``) on the batch; on
    top of the task's advantages (raw rewards here, through a post-process that keeps them)."""
    student, teacher = tiny_model("qwen2"), tiny_model("qwen2", seed=1)
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    run_dir, coef = tmp_path / "run", 0.25
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(student),
            "--prompt-data",
            str(prompts),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "1",
            "--save-train-details",
            "--rollout-function-path",
            "rollout_functions.single_turn:generate_rollout",
            "--rm-type",
            "random",
            "--custom-reward-post-process-path",
            f"{PLUGINS}.rewards_as_given",
            "--use-opd",
            "--opd-type",
            "megatron",
            "--opd-teacher-load",
            str(teacher),
            "--opd-kl-coef",
            str(coef),
            *SMALL_RUN,
        )
    )
    check_distilled(run_dir, teacher, coef, task_reward=True)


def test_a_rollout_worker_that_outlives_its_rollout(tiny_model, tmp_path, monkeypatch):
    """slime's fully-async shape: the first rollout starts a worker thread with its own event loop that
    keeps the ``data_buffer`` it was handed and generates through slime's default path; the next
    rollout's groups must reach that same buffer, and the worker's router calls carry the job's key."""
    log = tmp_path / "slime_log.jsonl"
    monkeypatch.setenv("SLIME_PLUGIN_LOG", str(log))
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            f"{PLUGINS}.rollout_with_a_lasting_worker",
            "--rm-type",
            "random",
            "--save-debug-rollout-data",
            str(tmp_path / "rollout_{rollout_id}.jsonl"),
            "--output-dir",
            str(tmp_path / "run"),
            "--num-rollout",
            "2",
            *SMALL_RUN,
        )
    )
    assert [json.loads(line) for line in log.read_text().splitlines()] == [
        {"rollout_id": 0, "same_buffer": True},
        {"rollout_id": 1, "same_buffer": True},
    ]
    for rollout_id in range(2):
        saved = [
            Sample.from_json(json.loads(line))
            for line in (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines()
        ]
        assert sorted(s.group_index for s in saved) == [2 * rollout_id] * 2 + [2 * rollout_id + 1] * 2
        for sample in saved:
            sample.validate()
            assert sample.response_length > 0 and sample.reward in (0, 1)


def test_a_rollout_replayed_from_a_dump_in_slimes_format(tiny_model, tmp_path):
    """``--save-debug-rollout-data DIR/{rollout_id}.pt`` writes slime's dump; a slime rollout function
    that replays it (slime's forge_load) trains on it in a later job, rollout after rollout (the
    second replays the first's file in the places of its own tasks); ``--load-debug-rollout-data``
    trains on it with no servers."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    dump = tmp_path / "dump" / "{rollout_id}.pt"
    check(
        inverted(
            "train",
            "--debug-rollout-only",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            "rollout_functions.single_turn:generate_rollout",
            "--rm-type",
            "random",
            "--save-debug-rollout-data",
            str(dump),
            "--output-dir",
            str(tmp_path / "first"),
            "--num-rollout",
            "1",
            *SMALL_RUN,
        )
    )
    saved = torch.load(tmp_path / "dump" / "0.pt", weights_only=True)
    assert saved["rollout_id"] == 0 and len(saved["samples"]) == 4
    assert {
        "tokens",
        "response",
        "response_length",
        "rollout_log_probs",
        "loss_mask",
        "status",
        "reward",
        "index",
        "group_index",
        "teacher_log_probs",
        "spec_info",
        "prefix_cache_info",
    } <= set(saved["samples"][0])
    dumped = {(s["group_index"], s["_index"]): s["tokens"] for s in saved["samples"]}

    run_dir = tmp_path / "replayed"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            f"{PLUGINS}.replay_dump",
            "--load-forge-rollout-data",
            str(dump),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *SMALL_RUN,
        )
    )
    stored = stored_samples(run_dir)
    assert len(stored) == 8
    for (group, index), sample in stored.items():
        source = sample.metadata.get("replayed_from")
        assert (group < 2) == (source is None)  # rollout 0's tasks are the dump's own
        assert sample.tokens == dumped[(group, index) if source is None else (source["group_index"], source["index"])]
    assert len(metrics_rows(run_dir)) == 2

    check(
        inverted(
            "train",
            "--debug-train-only",
            "--load-debug-rollout-data",
            str(dump),
            "--hf-checkpoint",
            str(tiny_model()),
            "--output-dir",
            str(tmp_path / "offline"),
            "--num-rollout",
            "1",
            "--lr",
            "1e-3",
            "--log-level",
            "warning",
        )
    )
    trained = sum(sum(s["loss_mask"]) for s in saved["samples"])
    assert metrics_rows(tmp_path / "offline")[0]["train/loss_tokens"] == trained


def test_a_rollout_function_that_never_returns_does_not_keep_the_job_from_stopping(tiny_model, tmp_path):
    """slime's sleep_rollout never returns, by design; Ctrl-C still stops the job."""
    log = tmp_path / "slime_log.jsonl"
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    argv = [
        sys.executable,
        "-m",
        "inverted.cli",
        "train",
        "--debug-rollout-only",
        "--hf-checkpoint",
        str(tiny_model()),
        "--prompt-data",
        str(prompts),
        "--rollout-function-path",
        f"{PLUGINS}.sleep_forever",
        "--output-dir",
        str(tmp_path / "run"),
        "--num-rollout",
        "1",
        *ONE_ENGINE_RUN,
    ]
    env = {
        **os.environ,
        "SLIME_PLUGIN_LOG": str(log),
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "PYTHONFAULTHANDLER": "1",
    }  # a job that does not stop is sent SIGABRT: it prints where each thread waits
    job = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not log.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert log.exists() and job.poll() is None, "the rollout function was not reached"
        job.send_signal(signal.SIGINT)
        try:  # communicate, not wait: it drains stderr, whose full pipe would block the job
            _, err = job.communicate(timeout=120)  # a plug-in thread the job waited for would hang here
        except subprocess.TimeoutExpired:
            job.send_signal(signal.SIGABRT)
            try:
                err = job.communicate(timeout=15)[1]
            except subprocess.TimeoutExpired:
                job.kill()
                err = job.communicate()[1]
            raise AssertionError(f"the job did not stop within 120 s of Ctrl-C:\n{err[-8000:]}") from None
    finally:
        job.kill()
    assert job.returncode != 0, err[-4000:]


def test_slime_rollout_functions_side_by_side_in_async_mode(tiny_model, tmp_path):
    """``--async-mode`` runs a rollout per group, side by side, on threads: each call of a slime rollout
    function gets its own group from the one ``data_buffer``."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    run_dir = tmp_path / "run"
    check(
        inverted(
            "train",
            "--async-mode",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--rollout-function-path",
            f"{PLUGINS}.rollout_by_slimes_default_path",
            "--rm-type",
            "random",
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *SMALL_RUN,
        )
    )
    assert len(metrics_rows(run_dir)) == 2
    assert all(sample.response_length > 0 for sample in stored_samples(run_dir).values())


def test_a_generate_function_that_records_neither_logprobs_nor_versions_trains(tiny_model, tmp_path):
    """slime's contract: a generate function may call its server its own way. Its Samples come with no
    rollout log-probs (the trainer's own old log-probs stand in; TIS and the mismatch metric leave them
    out, and count them) and no versions (each token's is the version serving when its rollout started:
    exact here, where training waits for the rollout). Evaluation Samples, never trained, alike."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    data, run_dir = tmp_path / "rollout_{rollout_id}.jsonl", tmp_path / "run"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--custom-generate-function-path",
            f"{PLUGINS}:generate_its_own_way",
            "--use-tis",
            "--eval-interval",
            "2",
            "--eval-prompt-data",
            str(prompts),
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *ONE_ENGINE_RUN,
        )
    )
    rows = metrics_rows(run_dir)
    trained = [m for m in rows if "train/loss" in m]
    assert [m["train/samples_without_rollout_logprobs"] for m in trained] == [4.0, 4.0]
    assert all("train/train_rollout_logprob_abs_diff" not in m for m in trained)  # nothing to compare with
    assert all(m["train/tis_mean"] == 1.0 for m in trained)  # no importance weight without the sampler's log-probs
    evaluations = [m for m in rows if "eval/pass_rate" in m]
    assert [m["weight_version"] for m in evaluations] == [0, 2] and all(m["eval/failed"] == 0 for m in evaluations)
    for rollout_id, version in ((0, "default"), (1, "1")):  # the servers' version when each rollout started
        saved = [
            Sample.from_json(json.loads(line))
            for line in (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines()
        ]
        assert len(saved) == 4
        for sample in saved:
            sample.validate()
            assert sample.rollout_log_probs is None and sample.response_length > 0
            assert sample.weight_versions == [version] * sample.response_length
            assert "weight_versions_inferred" not in sample.metadata


def test_a_slime_fan_out_trains_every_sample_of_a_task_each_with_its_own_reward(tiny_model, tmp_path):
    """slime's fan-out contract (a generate function answers a task with several Samples that share its
    ``rollout_id``, as slime's ``compact_generate``): each Sample is scored by the per-Sample reward
    model, served as one of its group and trained; the buffer stores a task's Samples together. Before,
    only a task's first Sample was scored, and the trainer refused the others ("reward is missing")."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    data, run_dir = tmp_path / "trained_{rollout_id}.jsonl", tmp_path / "run"
    check(
        inverted(
            "train",
            "--hf-checkpoint",
            str(tiny_model()),
            "--prompt-data",
            str(prompts),
            "--custom-generate-function-path",
            f"{PLUGINS}:generate_fanned_out",
            "--custom-rm-path",
            f"{PLUGINS}:response_length_rm",
            "--save-debug-rollout-data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--num-rollout",
            "2",
            *ONE_ENGINE_RUN,
        )
    )
    rows = [r for r in metrics_rows(run_dir) if "rollout/samples" in r]
    assert len(rows) == 2
    for step, row in enumerate(rows):
        lines = Path(str(data).format(rollout_id=step)).read_text().splitlines()
        trained = [Sample.from_json(json.loads(line)) for line in lines]
        per_task = Counter((s.group_index, s.index) for s in trained)
        # 1 + slime's index % 3, slime's index counting across the dataset (group x 2 + index)
        assert all(count == 1 + (2 * group + index) % 3 for (group, index), count in per_task.items()), per_task
        assert max(per_task.values()) > 1 and all(s.reward == s.response_length / 16 for s in trained)
        assert row["rollout/trained_samples"] == len(trained)
    assert any(s.metadata.get("siblings") for s in stored_samples(run_dir).values())  # stored as one task
    # each Sample of a fan-out keeps its own row of the trainer's details (``inverted view``), told apart by
    # its branch; before, a task's Samples shared one key and each overwrote the one before
    with sqlite3.connect(run_dir / "train_details.db") as details:
        kept = details.execute("SELECT COUNT(*) FROM details").fetchone()[0]
    assert kept == sum(row["rollout/trained_samples"] for row in rows)
