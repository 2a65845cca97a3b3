"""The rollout side's flags: the rollout servers and their router (``ServersConfig``), and the rollouts
the job runs on them (``RolloutConfig``: the rollout function, its batch, evaluation)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inverted.config import (
    CHAT_TEMPLATE_HELP,
    CONTEXT_LENGTH_HELP,
    SAMPLING_MASK_HELP,
    SAMPLING_MASK_TOP_K,
    flag_name,
    json_object,
    option,
    require,
)


@dataclass(kw_only=True, slots=True)
class ServersConfig:
    """Rollout servers behind the real sgl-router; ``--router-*`` (and ``--sglang-*``) pass through."""

    hf_checkpoint: str = option("", "Hugging Face checkpoint the engines serve", path=True)
    rollout_backend: Literal["auto", "sglang", "embedded"] = option(
        "auto",
        "real SGLang servers or embedded engines (auto: SGLang on a GPU where it is installed, else the "
        "embedded engine, which starts in seconds and decodes faster on a CPU)",
    )
    rollout_sglang_python: str = option(
        "",
        "the Python that runs real SGLang (make sglang installs one: .sglang/bin/python); empty: this one",
        path=True,
    )
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP, path=True)
    num_engines: int = option(2, "rollout servers to start")
    rollout_num_gpus: int = option(0, "GPUs for real SGLang servers (0: --num-engines x --rollout-num-gpus-per-engine)")
    rollout_num_gpus_per_engine: int = option(1, "GPUs per real SGLang server (its tensor parallelism)")
    rollout_node_resource: str | None = option(
        None, "a Ray custom resource (ray start --resources) that only the rollout nodes offer: the servers go there"
    )
    engine_device: Literal["cpu", "cuda"] = option("cpu", "device of the embedded engines")
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto",
        "weight dtype of the embedded engines (auto: float32 on a CPU, bfloat16 on CUDA; --sglang-dtype sets it "
        "too). bfloat16 on a CPU with AVX512-BF16 or AMX halves what a decode step reads; the rollout log-probs "
        "are then the bfloat16 policy's, as sampled, and --use-tis corrects the trainer's ratios for the gap",
    )
    engine_max_running_requests: int = option(64, "--max-running-requests of each engine")
    engine_stored_copy_rows: int = option(
        -1,
        "--stored-copy-rows of each embedded engine: steps of up to this many rows multiply copies of the packed "
        "weight matrices as stored, where that is faster (-1: measured at load; 0: none, saving their memory)",
    )
    max_total_tokens: int = option(
        0,
        "token positions each server's KV cache holds, over all its requests (SGLang's --max-total-tokens; 0: "
        "each backend's default: the embedded engine's a quarter of the machine's memory, real SGLang's on a CPU "
        "32,768)",
    )
    context_length: int = option(0, CONTEXT_LENGTH_HELP)
    engine_threads: int = option(0, "torch threads per engine (0: cores divided among the engines)")
    router_host: str = option("127.0.0.1", "address the router binds")
    router_port: int = option(0, "router port (0: a free port)")
    startup_timeout: float = option(180.0, "seconds to wait for every process to become healthy")
    log_dir: str = option("runs/servers", "directory for the engines' and the router's logs", path=True)
    admin_api_key: str | None = option(
        None,
        "key every rollout server requires on its weight and control routes, and the router on its worker "
        "routes (sgl-router's control plane): inverted train sets a random one",
    )
    router_api_key: str | None = option(
        None,
        "key the router requires on /generate and sends on to the rollout servers, which require it too "
        "(sgl-router's and SGLang's --api-key): inverted train sets a random one",
    )

    def __post_init__(self) -> None:
        require(bool(self.hf_checkpoint), "--hf-checkpoint", self.hf_checkpoint, "a checkpoint directory")
        require(
            not self.chat_template or Path(self.chat_template).is_file(),
            "--chat-template",
            self.chat_template,
            "a Jinja template file",
        )
        require(self.num_engines >= 1, "--num-engines", self.num_engines, ">= 1")
        require(self.max_total_tokens >= 0, "--max-total-tokens", self.max_total_tokens, ">= 0")
        require(
            self.rollout_num_gpus_per_engine >= 1,
            "--rollout-num-gpus-per-engine",
            self.rollout_num_gpus_per_engine,
            ">= 1",
        )
        require(
            self.rollout_num_gpus % self.rollout_num_gpus_per_engine == 0,
            "--rollout-num-gpus",
            self.rollout_num_gpus,
            "a multiple of --rollout-num-gpus-per-engine",
        )
        if self.rollout_num_gpus:
            self.num_engines = self.rollout_num_gpus // self.rollout_num_gpus_per_engine
        require(0 <= self.router_port <= 65535, "--router-port", self.router_port, "0..65535")
        require(self.startup_timeout > 0, "--startup-timeout", self.startup_timeout, "> 0")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """The rollout side of ``inverted train``: rollout function, environment, sampling, evaluation, debug modes."""

    rollout_function_path: str = option(
        "rollout_functions.agent:generate_rollout",
        "module:function turning leased tasks into Samples (built-in: rollout_functions.agent | single_turn | "
        "subprocess_agent); slime's generate_rollout(args, rollout_id, data_buffer, evaluation) works too",
    )
    env_path: str | None = option(
        None, "module:function(task, client) -> reward: the environment the agent rollout runs"
    )
    env_args: str | None = option(
        None,
        "JSON object of keyword arguments --env-path is called with besides (task, client), e.g. envs.verifiers' "
        '{"env": ID, "args": {...}}: which code runs is the command line\'s choice, never a dataset row\'s',
    )
    custom_rm_path: str | None = option(
        None,
        "module:function(sample) -> reward (or slime's async (args, sample)) for every Sample the rollout "
        "function left without one",
    )
    group_rm: bool = option(
        False, "--custom-rm-path scores a whole group at once: (samples) -> rewards, or slime's (args, samples)"
    )
    custom_generate_function_path: str | None = option(
        None,
        "slime's async generate(args, sample, sampling_params) -> Sample | list[Sample], run for every task "
        "inside the single_turn rollout (it calls the router itself)",
    )
    rollout_sample_filter_path: str | None = option(
        None,
        "module:function(groups) -> None setting remove_sample on Samples to keep out of the loss (slime's "
        "(args, groups) too)",
    )
    eval_function_path: str | None = option(None, "rollout function for evaluation (default: --rollout-function-path)")
    custom_rollout_log_function_path: str | None = option(
        None,
        "module:function(rollout_id, samples, metrics, seconds) -> bool (True: skip the default rollout "
        "metrics); slime's (rollout_id, args, samples, rollout_extra_metrics, rollout_time) too",
    )
    custom_eval_rollout_log_function_path: str | None = option(
        None,
        "module:function(rollout_id, data, metrics) -> bool (True: skip the default eval metrics); slime's "
        "(rollout_id, args, data, extra_metrics) too",
    )
    agent_command: str | None = option(
        None,
        "shell command of an existing agent for the subprocess_agent rollout (gets OPENAI_BASE_URL, "
        "OPENAI_API_KEY, INVERTED_TASK and INVERTED_REWARD_FILE)",
    )
    rollout_batch_size: int = option(8, "prompts per rollout (each gives --n-samples-per-prompt samples)")
    max_sampling_rounds: int = option(
        1,
        "sync mode: a step rolls out up to this many rounds of --rollout-batch-size prompts until the buffer holds "
        "--rollout-batch-size groups its filters keep, then trains what it has (DAPO's dynamic sampling refills "
        "the batch: > 1 with --dynamic-sampling-filter-path); groups beyond the batch wait for the next step",
    )
    rollout_max_response_len: int = option(256, "most tokens sampled in one model call")
    rollout_temperature: float = option(1.0, "sampling temperature; training log-probs use the same")
    rollout_top_p: float = option(1.0, "nucleus sampling")
    rollout_top_k: int = option(-1, "sample from the k most likely tokens only (-1: no cut)")
    sampling_mask_top_k: int = option(SAMPLING_MASK_TOP_K, SAMPLING_MASK_HELP)
    rollout_concurrency: int = option(64, "episodes run at the same time")
    rollout_episode_timeout: float = option(600.0, "seconds one episode may take; then it is a failed Sample")
    rollout_side_calls: Literal["leave-out", "train"] = option(
        "leave-out",
        "an episode's calls that named another model than its main one (a harness's title, quota probe "
        "or second model) are recorded as their own branches and left out of the episode's Sample "
        "(leave-out), or may be it like any branch (train)",
    )
    eval_interval: int = option(0, "evaluate every N rollouts on --eval-prompt-data (0: never)")
    eval_prompt_data: str | None = option(None, "prompt dataset for evaluation (same keys as --prompt-data)", path=True)
    n_samples_per_eval_prompt: int = option(1, "samples per evaluation prompt")
    eval_temperature: float = option(0.0, "sampling temperature of evaluation (0: greedy)")
    eval_max_response_len: int | None = option(
        None, "most tokens sampled in one model call of evaluation (default: --rollout-max-response-len)"
    )
    eval_env_args: str | None = option(
        None,
        "JSON object of keyword arguments --env-path is called with in evaluation (default: --env-args), e.g. "
        "the agent as its users run it where training runs it coached",
    )
    eval_variants: str | None = option(
        None,
        "JSON object {name: keyword arguments}: --env-path evaluated again with each, beside the main "
        "evaluation, its figures as eval/NAME/*",
    )
    debug_rollout_only: bool = option(False, "rollouts only, no trainer: report throughput and save the Samples")
    bootstrap_from: str | None = option(
        None,
        "a run directory (or its buffer.db) whose successful episodes rollout_functions.bootstrap plays again "
        "through --env-path, as SFT data",
        path=True,
    )
    save_debug_rollout_data: str | None = option(
        None,
        "write each rollout's Samples as jsonl here (a .pt path: slime's dump); '{rollout_id}' in the path "
        "makes one file per rollout",
        path=True,
    )

    @property
    def cut_sampling(self) -> bool:
        """Whether the rollouts sample from a cut distribution (``--rollout-top-p`` < 1, ``--rollout-top-k``)."""
        return self.rollout_top_p < 1 or self.rollout_top_k > 0

    @property
    def biased_ratios(self) -> bool:
        """Cut sampling whose kept sets are not recorded (``--sampling-mask-top-k 0``): every ratio against the
        trainer's whole-vocabulary log-probs is off."""
        return self.cut_sampling and not self.sampling_mask_top_k

    def __post_init__(self) -> None:
        for name in ("env_args", "eval_env_args", "eval_variants"):
            if isinstance(getattr(self, name), dict):  # a YAML config's mapping
                setattr(self, name, json.dumps(getattr(self, name)))
            value = getattr(self, name)
            require(value is None or json_object(value) is not None, flag_name(name), value, "a JSON object")
        require(
            all(
                isinstance(v, dict) and name and "/" not in name
                for name, v in json.loads(self.eval_variants or "{}").items()
            ),
            "--eval-variants",
            self.eval_variants,
            "{name: {keyword: value}} with names without '/'",
        )
        for name in (
            "rollout_batch_size",
            "max_sampling_rounds",
            "rollout_max_response_len",
            "rollout_concurrency",
            "n_samples_per_eval_prompt",
        ):
            require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        require(
            self.eval_max_response_len is None or self.eval_max_response_len >= 1,
            "--eval-max-response-len",
            self.eval_max_response_len,
            ">= 1",
        )
        require(0 < self.rollout_top_p <= 1, "--rollout-top-p", self.rollout_top_p, "in (0, 1]")
        require(
            self.rollout_top_k == -1 or self.rollout_top_k >= 1, "--rollout-top-k", self.rollout_top_k, "-1 or >= 1"
        )
        require(
            not self.sampling_mask_top_k or self.rollout_top_k <= 4096,
            "--rollout-top-k",
            self.rollout_top_k,
            "at most 4096 (the servers' --sampling-mask-max-tokens) while sampling masks are recorded",
        )
        require(self.rollout_temperature > 0, "--rollout-temperature", self.rollout_temperature, "> 0")
        require(self.rollout_episode_timeout > 0, "--rollout-episode-timeout", self.rollout_episode_timeout, "> 0")
        require(self.eval_interval >= 0, "--eval-interval", self.eval_interval, ">= 0")
