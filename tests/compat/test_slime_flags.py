"""slime's command line: every flag of slime's train.py, read from slime's own parser, and what each does here.

``inverted/compat/slime_flags.json`` was read from slime's, Megatron-LM's, SGLang's and sgl-router's
own parser code (``tools/slime_flags.py``); ``slime_script_flags.txt`` lists the flags slime's
launch scripts pass (``tools/slime_scripts.py``). Neither needs slime installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from inverted import cli
from inverted.compat import slime_config, slime_flags
from inverted.compat.slime import SlimeArgs
from inverted.config import plugin_flags
from inverted.errors import ConfigError

SCRIPT_FLAGS = [
    line for line in (Path(__file__).with_name("slime_script_flags.txt")).read_text().split() if line.startswith("--")
]


def test_the_table_is_slimes_parser_and_every_rule_names_a_flag_of_it():
    table = slime_flags.table()
    assert len(table) > 1500 and {f.source for f in table.values()} == {"megatron", "slime", "sglang"}
    assert len(slime_flags.read_from()["slime"]) == 40 and slime_flags.read_from()["sglang"] == "0.5.23"
    assert table["rollout_max_context_len"].default is None and table["sglang_server_concurrency"].default == 512
    assert table["layernorm_epsilon"].options == ("--norm-epsilon",)  # Megatron's dest, not the flag's name
    for rules in (
        slime_flags.SAME,
        slime_flags.CHECKED,
        slime_flags.NO_EFFECT,
        slime_flags.REFUSED,
        slime_flags.ACCEPTED_VALUES,
    ):
        assert not [dest for dest in rules if dest not in table and dest not in slime_flags.MODEL_FLAGS]


def test_no_flag_of_slimes_launch_scripts_is_a_bare_unrecognized():
    """Each is inverted's own, implemented, checked, accepted without effect, or refused with a reason;
    the one not in slime's parser at all (a stale example's) says so."""
    train = cli.build_parser()._subparsers._group_actions[0].choices["train"]
    ours = {o for action in train._actions for o in action.option_strings}
    assert len(SCRIPT_FLAGS) > 200
    outcome = {flag: ("inverted", "") if flag in ours else slime_flags.describe(flag) for flag in SCRIPT_FLAGS}
    assert all(why for state, why in outcome.values() if state != "inverted")
    assert [f for f, (state, _) in outcome.items() if state == "unrecognized"] == ["--ref-micro-batch-size"]
    assert sum(state in ("inverted", "same", "checked", "no effect") for state, _ in outcome.values()) >= 200


def captured_train(monkeypatch, *argv: str):
    """``inverted train ARGV`` parsed as the command line does, up to the job's start."""
    seen = {}
    monkeypatch.setattr(cli, "setup_logging", lambda *a, **k: None)  # the test's own log capture stays
    monkeypatch.setitem(
        cli.COMMANDS,
        "train",
        (cli.COMMANDS["train"][0], lambda *a: seen.setdefault("call", a), cli.COMMANDS["train"][2]),
    )
    cli.main(["train", *argv])
    return seen["call"]


QWEN2_SCRIPT = [  # from slime's scripts/models/qwen2.5-*.sh and run-*.sh, for the tiny qwen2's shape
    "--swiglu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "160",
    "--num-attention-heads",
    "4",
    "--use-rotary-position-embeddings",
    "--disable-bias-linear",
    "--add-qkv-bias",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--rotary-base",
    "1000000",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--vocab-size",
    "1280",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
    "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32",
    "--attention-backend",
    "flash",
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
    "--use-dynamic-batch-size",
    "--micro-batch-size",
    "1",
    "--optimizer",
    "adam",
    "--lr-decay-style",
    "constant",
    "--ref-load",
    "/root/Qwen2.5-0.5B_torch_dist",
    "--use-wandb",
    "--wandb-project",
    "slime-dev",
    "--num-steps-per-rollout",
    "2",
    "--rollout-max-context-len",
    "1024",
    "--calculate-per-token-loss",
    "--sglang-mem-fraction-static",
    "0.7",
    "--sglang-server-concurrency",
    "64",
    "--sglang-max-running-requests",
    "16",
    "--sglang-cuda-graph-bs",
    "1",
    "2",
    "4",
    "--wandb-key",
    "wandb-secret-1234",
]


def test_a_slime_launch_line_parses_and_acts_as_slime_would(monkeypatch, tiny_model, tmp_path, caplog):
    model = str(tiny_model("qwen2"))
    cfg, _, sglang, slime = captured_train(
        monkeypatch,
        "--hf-checkpoint",
        model,
        "--prompt-data",
        "p.jsonl",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        *QWEN2_SCRIPT,
    )
    assert slime.given["num_layers"] == 2 and slime.given["layernorm_epsilon"] == 1e-6
    with caplog.at_level(logging.INFO):
        forwarded = slime_config.apply(cfg, slime, sglang, "embedded")
    assert forwarded == []  # the embedded engine is no SGLang: nothing is forwarded
    assert cfg.train.global_batch_size == 8 and cfg.servers.context_length == cfg.proxy.context_length == 1024
    assert cfg.servers.engine_max_running_requests == 16
    listed = caplog.text
    for line in (
        "--use-wandb=True: metrics go to",
        "--attention-backend='flash': a GPU kernel",
        "--sglang-mem-fraction-static=0.7: a setting of real SGLang",
        "--sglang-cuda-graph-bs 1 2 4: not a flag slime passes to SGLang 0.5.23; the embedded engine ignores it",
        "--ref-load='/root/Qwen2.5-0.5B_torch_dist': the KL",
    ):
        assert line in listed
    assert "--num-layers" not in listed and "--calculate-per-token-loss" not in listed  # checked / implemented
    # Megatron's recomputation flags are the trainer's own
    assert (cfg.train.recompute_granularity, cfg.train.recompute_method, cfg.train.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    ) and "--recompute" not in listed
    assert "--wandb-key=(hidden): metrics go to" in listed and "wandb-secret-1234" not in listed
    args = SlimeArgs.of(plugin_flags(cfg.buffer))  # the buffer's args, from what the job hands it
    assert (
        args.calculate_per_token_loss,
        args.wandb_project,
        args.sglang_server_concurrency,
        args.num_layers,
        args.rollout_batch_size,
        args.n_samples_per_prompt,
    ) == (True, "slime-dev", 64, 2, 4, 4)
    assert (args.use_rollout_logprobs, args.rollout_max_context_len, args.sglang_router_request_timeout_secs) == (
        False,
        1024,
        14400,
    )  # slime's defaults for the flags not given
    assert "api_key" not in cfg.buffer.plugin_args and "wandb-secret-1234" not in cfg.buffer.plugin_args  # cmdline
    args.rollout_id_seen = 3  # a plug-in sets attributes on its copy, as slime's do
    assert args.rollout_id_seen == 3 and "rollout_id_seen" not in json.loads(cfg.train.plugin_args)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-layers", "3"], "--num-layers 3 != 2 (num_hidden_layers in"),
        (["--untie-embeddings-and-output-weights"], "--untie-embeddings-and-output-weights True != False"),
        (["--rotary-base", "10000"], "--rotary-base 10000 != 1000000.0 (rope_theta"),
    ],
)
def test_model_flags_that_do_not_describe_the_checkpoint_stop_the_job(monkeypatch, tiny_model, flags, message):
    cfg, _, sglang, slime = captured_train(
        monkeypatch, "--hf-checkpoint", str(tiny_model("qwen2")), "--prompt-data", "p.jsonl", *flags
    )
    with pytest.raises(ConfigError, match="slime's model flags do not describe --hf-checkpoint") as error:
        slime_config.apply(cfg, slime, sglang, "embedded")
    assert message in str(error.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--lr-decay-style", "cosine"],
            "--lr-decay-style='cosine' is a slime flag inverted does not have: the learning rate is constant here",
        ),
        (
            ["--min-lr", "1e-7", "--lr-warmup-iters", "5"],
            "--lr-warmup-iters=5 is a slime flag inverted does not have: "
            "Megatron-LM's flag, which inverted does not implement; only its "
            "default 0 is accepted",
        ),
        (["--eval-top-p", "0.7"], "--eval-top-p=0.7 is a slime flag inverted does not have: slime's flag"),
        (
            ["--ref-micro-batch-size", "8"],
            "unrecognized arguments: --ref-micro-batch-size 8 (neither inverted's flags nor slime's train.py's)",
        ),
        (
            ["--data-source-path", "x:y"],
            "--data-source-path='x:y' is a slime flag inverted does not have: inverted's Data Buffer",
        ),
        (
            ["--prefill-num-servers", "2"],
            "--prefill-num-servers=2 is a slime flag inverted does not have: no prefill/decode",
        ),
    ],
)
def test_slime_flags_whose_behaviour_inverted_lacks_are_refused_with_the_reason(monkeypatch, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        captured_train(monkeypatch, "--hf-checkpoint", "m", "--prompt-data", "p.jsonl", *flags)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-opd"], "--use-opd needs --opd-type"),
        (["--opd-teacher-load", "t"], "--opd-teacher-load is set but --use-opd is not"),
        (
            ["--use-opd", "--opd-type", "sglang", "--opd-teacher-load", "t"],
            "--opd-teacher-load is for --opd-type megatron",
        ),
        (["--use-opd", "--opd-type", "megatron"], "--opd-type megatron needs --opd-teacher-load"),
        (
            ["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "LLAMA"],
            r"the teacher must have the policy's architecture \(slime's requirement\): arch 'llama' != 'qwen2'",
        ),
    ],
)
def test_on_policy_distillation_flags_are_checked_as_in_slime(monkeypatch, tiny_model, flags, message):
    flags = [str(tiny_model("llama")) if f == "LLAMA" else f for f in flags]
    cfg, _, sglang, slime = captured_train(
        monkeypatch, "--hf-checkpoint", str(tiny_model("qwen2")), "--prompt-data", "p.jsonl", *flags
    )
    with pytest.raises(ConfigError, match=message):
        slime_config.apply(cfg, slime, sglang, "embedded")


def test_on_policy_distillation_flags_reach_args(monkeypatch):
    cfg, _, sglang, slime = captured_train(
        monkeypatch,
        "--hf-checkpoint",
        "m",
        "--prompt-data",
        "p.jsonl",
        "--use-opd",
        "--opd-type",
        "sglang",
        "--opd-kl-coef",
        "0.5",
    )
    slime_config.apply(cfg, slime, sglang, "embedded")
    args = json.loads(cfg.train.plugin_args)
    assert (args["use_opd"], args["opd_type"], args["opd_kl_coef"]) == (True, "sglang", 0.5)
    # and the trainer's typed settings, which it acts on
    assert (cfg.train.loss.distill, cfg.train.loss.distill_teacher, cfg.train.loss.distill_kl_coef) == (
        "samples",
        None,
        0.5,
    )


def test_the_flags_the_trainer_acts_on_set_its_typed_settings(monkeypatch, tiny_model):
    teacher = str(tiny_model("qwen2"))
    cfg, _, sglang, slime = captured_train(
        monkeypatch,
        "--hf-checkpoint",
        teacher,
        "--prompt-data",
        "p.jsonl",
        "--use-opd",
        "--opd-type",
        "megatron",
        "--opd-teacher-load",
        teacher,
        "--disable-rewards-normalization",
        "--calculate-per-token-loss",
        "--log-probs-chunk-size",
        "256",
    )
    loss = cfg.train.loss
    assert (loss.distill, loss.raw_rewards, loss.per_token_loss, cfg.train.logprob_chunk_size) == (
        "none",
        False,
        False,
        1024,
    )
    slime_config.apply(cfg, slime, sglang, "embedded")
    assert (loss.distill, loss.distill_teacher, loss.raw_rewards, loss.per_token_loss) == (
        "teacher",
        teacher,
        True,
        True,
    )
    assert cfg.train.logprob_chunk_size == 256 and SlimeArgs.of(plugin_flags(cfg.train)).log_probs_chunk_size == 256


def test_sglang_flags_go_to_real_sglang_only_where_it_has_them(monkeypatch, tiny_model):
    plan = slime_flags.plan_sglang(
        ["--mem-fraction-static", "0.7", "--server-concurrency", "64", "--context-length", "2048"], "sglang"
    )
    assert plan.forward == ["--mem-fraction-static", "0.7", "--context-length", "2048"]  # slime's own is not SGLang's
    assert plan.slime["sglang_server_concurrency"] == 64
    for flag in ("--cuda-graph-bs", "--tp-size"):  # renamed in SGLang 0.5.23; set by slime from its own flags
        with pytest.raises(ConfigError, match=f"--sglang-{flag[2:]} 8: not a flag slime passes to SGLang 0.5.23"):
            slime_flags.plan_sglang([flag, "8"], "sglang")
    for backend in ("sglang", "embedded"):  # slime's --sglang-config was dropped without a word: the job ran on
        with pytest.raises(ConfigError, match="--sglang-config='/nonexistent.yaml': inverted starts --num-engines"):
            slime_flags.plan_sglang(["--config", "/nonexistent.yaml"], backend)


def test_custom_config_sets_args_as_slime_does(monkeypatch, tiny_model, tmp_path):
    config = tmp_path / "custom.yaml"
    config.write_text("search_backend: local\nmax_turns: 3\n")
    cfg, _, sglang, slime = captured_train(
        monkeypatch,
        "--hf-checkpoint",
        str(tiny_model("qwen2")),
        "--prompt-data",
        "p.jsonl",
        "--custom-config-path",
        str(config),
    )
    slime_config.apply(cfg, slime, sglang, "embedded")
    args = SlimeArgs.of(plugin_flags(cfg.train))
    assert (args.search_backend, args.max_turns) == ("local", 3)
    config.write_text("use_tis: true\ntis_clip: 3.0\ntis_mode: truncate\n")  # slime's mis.yaml sets use_tis
    slime_config.apply(cfg, slime, sglang, "embedded")
    assert (cfg.train.loss.use_tis, cfg.train.loss.tis_clip) == (True, 3.0)  # inverted's flags, set as slime sets args
    assert SlimeArgs.of(plugin_flags(cfg.train)).tis_mode == "truncate"
    config.write_text("tis_clip: -1.0\n")
    with pytest.raises(ConfigError, match="--tis-clip-low"):  # the section's own checks run on the new values
        slime_config.apply(cfg, slime, sglang, "embedded")


def test_slimes_named_evaluation_set_is_taken(monkeypatch):
    cfg, *_ = captured_train(
        monkeypatch,
        "--hf-checkpoint",
        "m",
        "--prompt-data",
        "p.jsonl",
        "--eval-prompt-data",
        "aime",
        "/data/aime.jsonl",
        "--eval-interval",
        "5",
    )
    assert cfg.rollout.eval_prompt_data == "/data/aime.jsonl"  # was: "unrecognized arguments: /data/aime.jsonl"
    with pytest.raises(SystemExit):
        captured_train(
            monkeypatch,
            "--hf-checkpoint",
            "m",
            "--prompt-data",
            "p.jsonl",
            "--eval-prompt-data",
            "aime",
            "a.jsonl",
            "gpqa",
            "g.jsonl",
        )


def test_the_sglang_flags_forwarded_are_sglangs_own_fields():
    """What ``plan_sglang`` forwards to real SGLang is a field of SGLang 0.5.23's ``ServerArgs``, as SGLang's
    own ``arg_groups/field_order.py`` lists them (the installed wheel), and slime's flags are not."""
    from tests.contract.sglang_code import server_args_fields

    fields = server_args_fields()
    forwarded = [
        f.dest[len("sglang_") :]
        for f in slime_flags.flags()
        if f.source == "sglang"
        and f.dest.startswith("sglang_")
        and f.dest not in slime_flags.SLIME_SGLANG
        and any(o.startswith("--sglang-") for o in f.options)
    ]
    assert len(forwarded) > 400
    assert not [name for name in forwarded if name not in fields]
    assert "server_concurrency" not in fields  # slime's own --sglang-server-concurrency: never forwarded
