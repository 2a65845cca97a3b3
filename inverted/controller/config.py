"""``inverted train``'s config: ``JobConfig``, one section per part the job runs, and ``LoopConfig``, the
loop's own."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from inverted.buffer.config import BufferConfig
from inverted.config import (
    option,
    passed,
    require,
    set_by,
)
from inverted.rollout.config import RolloutConfig, ServersConfig
from inverted.rollout.proxy.config import ProxyConfig
from inverted.train.config import LossConfig, TrainConfig

_SET_BY_JOB = set_by("inverted train")


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """How ``inverted train`` runs its parts together (the controller's section): where Ray places them,
    whether training and rollout share the devices, and whether they overlap (the loop, how stale a
    trained token may be, how often weights are pushed)."""

    ray_address: str | None = option(None, "Ray cluster to join ('auto' or HOST:PORT; default: start a local one)")
    colocate: bool = option(False, "training and rollout share the devices: servers release memory while training")
    async_mode: bool = option(
        False,
        "rollout never stops: training takes each batch as soon as the buffer holds it, and new weights are "
        "pushed while episodes run (see --max-weight-staleness, --update-weights-interval, --pause-mode)",
    )
    max_weight_staleness: int | None = option(
        None,
        "train only on groups whose oldest token is at most this many weight versions behind the policy "
        "(older ones: --stale-policy); async mode also starts no episode that would exceed it (default: no "
        "bound in sync mode, 1 in async mode, which is one-step-off-policy training)",
    )
    update_weights_interval: int = option(1, "push new weights into the rollout servers every N training steps")

    def __post_init__(self) -> None:
        require(self.update_weights_interval >= 1, "--update-weights-interval", self.update_weights_interval, ">= 1")
        if self.max_weight_staleness is None and self.async_mode:
            self.max_weight_staleness = 1
        require(
            self.max_weight_staleness is None or self.max_weight_staleness >= 0,
            "--max-weight-staleness",
            self.max_weight_staleness,
            ">= 0",
        )


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """``inverted train``: the main job, one section per part it runs (flags of all of them)."""

    train: TrainConfig
    rollout: RolloutConfig
    buffer: BufferConfig
    proxy: ProxyConfig
    servers: ServersConfig
    loop: LoopConfig

    # Fields the job sets itself when it starts each service (addresses, ports, keys, and files in
    # --output-dir), and fields whose flag is another part's (``share`` passes them), so they are not
    # flags of ``inverted train``; these values only pass the sections' checks until they are replaced.
    SETS: typing.ClassVar[dict[str, dict[str, Any]]] = {
        "train": {"plugin_args": None}
        | passed(TrainConfig, "chat_template")
        | passed(LossConfig, "rollout_temperature"),
        "buffer": {
            "db": _SET_BY_JOB,
            "host": "127.0.0.1",
            "port": 8600,
            "api_key": None,
            "workers": 1,
            "plugin_args": None,
        }
        | passed(BufferConfig, "reward_key", "partial_rollout", "log_level"),
        "proxy": {
            "router_url": _SET_BY_JOB,
            "tokenizer": _SET_BY_JOB,
            "proxy_host": "127.0.0.1",
            "proxy_port": 8700,
            "proxy_api_key": None,
            "router_api_key": None,
            "router_admin_api_key": None,
            "lora_name": None,
            "return_routed_experts": False,
        }
        | passed(ProxyConfig, "chat_template", "context_length", "sampling_mask_top_k", "log_level"),
        "servers": {
            "log_dir": _SET_BY_JOB,
            "admin_api_key": None,
            "router_api_key": None,
            "hf_checkpoint": _SET_BY_JOB,
        },
    }

    def __post_init__(self) -> None:
        self.share()

    def share(self) -> None:
        """One flag is one field, in the part that owns it; a part that needs the value too gets it here
        (at construction, and again from whatever changes an owner in place: slime's flags)."""
        train, rollout, proxy, servers = self.train, self.rollout, self.proxy, self.servers
        servers.hf_checkpoint = train.hf_checkpoint  # the servers serve the policy the trainer trains
        # the chats are rendered as the servers render them, and the template is saved with the checkpoints
        train.chat_template = proxy.chat_template = servers.chat_template
        proxy.context_length = servers.context_length  # a call is bounded by the servers' context
        # the trainer's log-probs at the temperature the rollouts sampled at; the proxy asks for the
        # sampling masks the rollouts record
        train.loss.rollout_temperature = rollout.rollout_temperature
        proxy.sampling_mask_top_k = rollout.sampling_mask_top_k
        # the buffer filters groups by the reward the loss trains on, and keeps the tokens of a
        # rollout that the proxy resumes
        self.buffer.reward_key = train.loss.reward_key
        self.buffer.partial_rollout = proxy.partial_rollout
        self.buffer.log_level = proxy.log_level = train.log_level

    def validate(self) -> None:
        """Cross-section checks, before any process starts."""
        train, rollout = self.train, self.rollout
        train.validate()
        require(
            not (train.debug_train_only and rollout.debug_rollout_only),
            "--debug-train-only",
            True,
            "not together with --debug-rollout-only",
        )
        if not train.debug_train_only:
            require(
                bool(self.buffer.prompt_data), "--prompt-data", self.buffer.prompt_data, "a .jsonl or .parquet dataset"
            )
        # Without a trainer nothing trains the adapter: an untrained one is the base model.
        require(
            not (rollout.debug_rollout_only and train.lora.lora_rank and not train.lora.lora_adapter_path),
            "--lora-rank",
            train.lora.lora_rank,
            "0 with --debug-rollout-only, unless --lora-adapter-path names the adapter to roll out with",
        )
        require(
            not rollout.eval_interval or bool(rollout.eval_prompt_data),
            "--eval-prompt-data",
            rollout.eval_prompt_data,
            "a dataset when --eval-interval is set",
        )
        loop = self.loop
        if loop.async_mode:
            require(
                not (loop.colocate or rollout.debug_rollout_only or train.debug_train_only),
                "--async-mode",
                True,
                "not with --colocate, --debug-rollout-only or --debug-train-only (rollout and training overlap)",
            )
        if loop.max_weight_staleness is not None:  # the servers lag the trainer by up to interval - 1 versions
            require(
                loop.max_weight_staleness >= loop.update_weights_interval - 1,
                "--max-weight-staleness",
                loop.max_weight_staleness,
                f">= --update-weights-interval - 1 = {loop.update_weights_interval - 1}",
            )
        samples = rollout.rollout_batch_size * self.buffer.n_samples_per_prompt
        require(
            not train.global_batch_size or samples % train.global_batch_size == 0,
            "--global-batch-size",
            train.global_batch_size,
            f"a divisor of --rollout-batch-size x --n-samples-per-prompt = {samples}",
        )
