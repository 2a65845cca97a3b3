"""slime plug-ins in a real job (`inverted train`, engines behind sgl-router, the buffer service): a
custom generate function's multi-turn tool loop, a batched group reward model, a buffer filter, a
sample filter, evaluation by another rollout function, and slime's logging hooks."""

from __future__ import annotations

import json

from envs.calculator import rows as calculator_rows
from envs.datasets import write_dataset
from inverted.types import Sample
from tests.job.test_train_job import SMALL_RUN, check, inverted, metrics_rows

PLUGINS = "tests.compat.slime_plugins"


def test_a_slime_custom_generate_job(tiny_model, tmp_path, monkeypatch):
    log = tmp_path / "slime_log.jsonl"
    monkeypatch.setenv("SLIME_PLUGIN_LOG", str(log))
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    data, run_dir = tmp_path / "rollout_{rollout_id}.jsonl", tmp_path / "run"
    check(inverted(
        "train", "--debug-rollout-only", "--hf-checkpoint", str(tiny_model()), "--prompt-data", str(prompts),
        "--custom-generate-function-path", f"{PLUGINS}:generate", "--custom-rm-path", f"{PLUGINS}:group_rm", "--group-rm",
        "--buffer-filter-path", f"{PLUGINS}.newest_groups_first", "--rollout-sample-filter-path", f"{PLUGINS}:remove_odd_indices",
        "--custom-rollout-log-function-path", f"{PLUGINS}:log_rollout", "--eval-interval", "1",
        "--eval-prompt-data", str(prompts), "--eval-function-path", f"{PLUGINS}:eval_rollout",
        "--custom-eval-rollout-log-function-path", f"{PLUGINS}:log_eval", "--save-debug-rollout-data", str(data),
        "--output-dir", str(run_dir), "--num-rollout", "2", *SMALL_RUN))

    for rollout_id in range(2):
        saved = [Sample.from_json(json.loads(line)) for line in
                 (tmp_path / f"rollout_{rollout_id}.jsonl").read_text().splitlines()]
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
            assert sample.metadata["response"]  # slime's response text, which our Sample keeps in its metadata
            assert sample.metadata.get("remove_sample", False) == (sample.index % 2 == 1)
        for group in {s.group_index for s in saved}:
            members = [s for s in saved if s.group_index == group]
            longest = max(s.response_length for s in members)
            assert [s.reward for s in members] == [float(s.response_length == longest) for s in members]

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    rollouts = [line for line in lines if "rollout_id" in line]
    assert [r["rollout_id"] for r in rollouts] == [0, 1] and all(r["samples"] == 4 and r["removed"] == 2 for r in rollouts)
    assert [line["eval"] for line in lines if "eval" in line] == [0, 1, 2]
    rows = metrics_rows(run_dir)
    assert all("rollout/reward_mean" not in row for row in rows)  # the log function took it over
    assert [row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row] == [0.5, 0.5, 0.5]


def test_slime_flags_we_do_not_have_and_wrong_plugins_fail_before_anything_starts(tiny_model, tmp_path):
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 2)
    base = ["train", "--hf-checkpoint", str(tiny_model()), "--prompt-data", str(prompts), "--output-dir", str(tmp_path / "run")]
    for args, message in [
        (["--data-source-path", "x:y"], "--data-source-path='x:y' is a slime flag inverted does not have: inverted's Data Buffer"),
        (["--num-layers", "5"], "slime's model flags do not describe --hf-checkpoint: --num-layers 5 != 2"),
        (["--sglang-config", "/nonexistent.yaml"], "--sglang-config='/nonexistent.yaml': inverted starts --num-engines"),
        (["--custom-generate-function-path", f"{PLUGINS}:group_rm"], "does not match def group_rm(args, sample, sampling_params)"),
        (["--custom-generate-function-path", f"{PLUGINS}:generate", "--rollout-function-path",
          "rollout_functions.subprocess_agent:generate_rollout"],
         "runs inside rollout_functions.single_turn:generate_rollout (slime's default rollout), not inside"),
        (["--custom-generate-function-path", f"{PLUGINS}:generate", "--loss-type", "custom_loss",
          "--custom-loss-function-path", f"{PLUGINS}:log_rollout"],
         "does not match def log_rollout(args, batch, logits, sum_of_sample_mean)"),
        (["--custom-generate-function-path", f"{PLUGINS}:generate", "--loss-type", "custom_loss"],
         "--custom-loss-function-path=None: expected a module:function with --loss-type custom_loss"),
        (["--custom-generate-function-path", f"{PLUGINS}:generate", "--buffer-filter-path", f"{PLUGINS}:no_such"],
         "--buffer-filter-path='tests.compat.slime_plugins:no_such': cannot load it"),
        (["--custom-generate-function-path", f"{PLUGINS}:generate", "--custom-tis-function-path", f"{PLUGINS}:group_rm"],
         "--custom-tis-function-path='tests.compat.slime_plugins:group_rm': expected def fn(args, *, pg_loss"),
    ]:
        result = inverted(*base, *args, timeout=120)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr[-3000:])
        assert not (tmp_path / "run" / "buffer.db").exists()


def test_plugins_in_slimes_current_style_run_unchanged(tiny_model, tmp_path):
    """August 2026's slime: a rollout function answering ``RolloutFnTrainOutput``, whose generate
    function grows each Sample with ``append_response_tokens`` and rewards it with a dict of any JSON
    values; slime's own ``check_reward_nonzero_std`` filter, by its module path, reading ``--reward-key``."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 8)
    data = tmp_path / "rollout_{rollout_id}.jsonl"
    custom = tmp_path / "custom.yaml"
    custom.write_text(f"args_log: {tmp_path / 'args'}\nmax_turns: 2\n")
    slime_launch = ["--num-layers", "2", "--hidden-size", "64", "--swiglu", "--use-wandb", "--wandb-project", "p",
                    "--sglang-mem-fraction-static", "0.7", "--custom-config-path", str(custom)]
    result = inverted(
        "train", "--debug-rollout-only", "--hf-checkpoint", str(tiny_model()), "--prompt-data", str(prompts),
        "--rollout-function-path", f"{PLUGINS}.rollout_noting_args", "--reward-key", "score",
        "--dynamic-sampling-filter-path", "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
        "--buffer-filter-path", f"{PLUGINS}:oldest_first_noting_args",
        "--save-debug-rollout-data", str(data), "--output-dir", str(tmp_path / "run"), "--num-rollout", "1",
        *SMALL_RUN, *slime_launch)
    check(result)
    # slime's args is one namespace, the same in the rollout function's process and the buffer service's
    noted = json.loads((tmp_path / "args.rollout").read_text())
    assert noted == json.loads((tmp_path / "args.buffer").read_text())
    assert noted == {"num_layers": 2, "use_wandb": True, "wandb_project": "p", "sglang_mem_fraction_static": 0.7,
                     "max_turns": 2, "reward_key": "score", "rollout_batch_size": 2, "calculate_per_token_loss": False,
                     "use_rollout_logprobs": False, "rm_type": None}
    for line in ("slime flags accepted with no effect here", "--use-wandb=True: metrics go to",
                 "--sglang-mem-fraction-static=0.7: a setting of real SGLang"):
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


def test_a_plugins_exception_in_the_buffer_reaches_the_console_with_its_traceback(tiny_model, tmp_path):
    """It was a bare ``status=500`` in the job, the traceback only in the buffer service's log."""
    prompts = write_dataset(calculator_rows, tmp_path / "calc.jsonl", 4)
    result = inverted("train", "--debug-rollout-only", "--hf-checkpoint", str(tiny_model()), "--prompt-data",
                      str(prompts), "--custom-generate-function-path", f"{PLUGINS}:generate",
                      "--dynamic-sampling-filter-path", f"{PLUGINS}:broken_filter", "--output-dir", str(tmp_path / "run"),
                      "--num-rollout", "1", *SMALL_RUN)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("inverted train: error:"):]
    assert ("in the Data Buffer service: --dynamic-sampling-filter-path='tests.compat.slime_plugins:broken_filter' "
            "raised TypeError: 'NoneType' object is not subscriptable") in error, error
    assert 'slime_plugins.py", line' in error and "in broken_filter" in error and "no_such_key" in error
