"""``inverted buffer``'s flags: the Data Buffer's store, datasets, grouping and plug-ins."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inverted.config import (
    PLUGIN_ARGS_HELP,
    option,
    require,
)


@dataclass(kw_only=True, slots=True)
class BufferConfig:
    """The Data Buffer service: durable tasks and trajectories (SQLite), leases, groups, staleness."""

    db: str = option("runs/buffer.db", "SQLite database file (created if missing; reopened on restart)", path=True)
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8600, "port to bind")
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on every route but /health")
    prompt_data: str | None = option(
        None, "prompt dataset (.jsonl or .parquet), loaded into the database once", path=True
    )
    input_key: str = option("input", "row key of the prompt (text or chat messages)")
    label_key: str | None = option("label", "row key of the label")
    metadata_key: str | None = option("metadata", "row key of per-prompt metadata")
    tool_key: str | None = option("tools", "row key of the prompt's OpenAI tools list")
    n_samples_per_prompt: int = option(1, "samples per prompt; they form one group")
    # the same flag as the trainer's: slime's group filters read it (args.reward_key)
    reward_key: str | None = option(None, "key of a dict reward to train on (default: the sum of its values)")
    rollout_shuffle: bool = option(False, "shuffle the dataset each epoch (deterministic for --rollout-seed)")
    rollout_seed: int = option(42, "seed of the per-epoch shuffle")
    num_epoch: int = option(0, "epochs to serve before leasing stops (0: no limit)")
    workers: int = option(1, "service processes sharing the database (more use more cores for ingest)")
    lease_seconds: float = option(600.0, "default lease length; an expired lease puts its task back")
    partial_rollout: bool = option(False, "keep aborted samples' tokens so the next lessee resumes them")
    stale_policy: Literal["drop", "retry"] = option("drop", "groups past --max-weight-staleness: drop, or sample again")
    buffer_max_request_bytes: int = option(
        256 * 1024**2, "largest request body accepted (a submission of Samples; larger ones get 413 unread)"
    )
    dynamic_sampling_filter_path: str | None = option(
        None,
        "module:function(samples) -> bool keeping a complete group (built-in: "
        "inverted.buffer.filters:drop_all_equal_rewards); slime's (args, samples, **kw) -> DynamicFilterOutput too",
    )
    buffer_filter_path: str | None = option(
        None,
        "module:function(groups, wanted, version) -> positions: which waiting complete groups a batch takes "
        "(default: the oldest first); slime's (args, rollout_id, buffer, num_samples) -> groups too",
    )
    plugin_args: str | None = option(None, PLUGIN_ARGS_HELP)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")

    def __post_init__(self) -> None:
        require(1 <= self.port <= 65535, "--port", self.port, "1..65535")
        require(self.n_samples_per_prompt >= 1, "--n-samples-per-prompt", self.n_samples_per_prompt, ">= 1")
        require(self.num_epoch >= 0, "--num-epoch", self.num_epoch, ">= 0")
        require(self.lease_seconds > 0, "--lease-seconds", self.lease_seconds, "> 0")
        require(self.workers >= 1, "--workers", self.workers, ">= 1")
        require(self.buffer_max_request_bytes >= 1, "--buffer-max-request-bytes", self.buffer_max_request_bytes, ">= 1")
