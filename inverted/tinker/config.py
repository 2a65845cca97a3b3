"""``inverted tinker-serve``'s config: the service's own flags, and the trainer's and rollout servers' it keeps."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from inverted.config import (
    flag_name,
    held,
    option,
    require,
    set_by,
)
from inverted.rollout.config import ServersConfig
from inverted.train.config import (
    CheckpointConfig,
    LossConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)

_SET_BY_SERVICE = set_by("inverted tinker-serve")


@dataclass(kw_only=True, slots=True)
class TinkerConfig:
    """The Tinker-compatible training service: the user's own script drives the loop (the official SDK)."""

    tinker_host: str = option("127.0.0.1", "address to bind")
    tinker_port: int = option(8800, "port to bind")
    tinker_api_keys: list[str] = option(
        [],
        "keys the service accepts (the SDK's TINKER_API_KEY; each begins tml-); empty: any tml- key. Each model "
        "belongs to the key that created it either way",
    )
    base_model: list[str] = option(
        [],
        "names clients may ask for the served checkpoint by (e.g. its hub name); it is always its path and folder name",
    )
    tinker_max_lora_rank: int = option(64, "the largest LoRA rank a client may ask for (the servers' --max-lora-rank)")
    tinker_max_models: int = option(4, "models (LoRA or full) held at once; a full fine-tuning model counts as one")
    tinker_max_batch_tokens: int = option(
        262144, "tokens one forward_backward may carry (beyond: a user error, before any work is spent)"
    )
    tinker_max_request_mb: float = option(64.0, "largest request body, in MB (the SDK chunks at 5 MB)")
    tinker_session_timeout: float = option(
        180.0,
        "seconds without a heartbeat after which a session is finished and its models unloaded (the SDK beats "
        "every 10 s and warns after 120)",
    )
    tinker_chunk_datums: int = option(
        1024,
        "datums per forward_backward request: the SDK splits larger calls into "
        "chunks of this many, sent at once (its fwdbwd_max_chunk_len)",
    )

    def __post_init__(self) -> None:
        require(0 <= self.tinker_port <= 65535, "--tinker-port", self.tinker_port, "0..65535")
        require(
            all(k.startswith(("tml-", "eyJ")) for k in self.tinker_api_keys),
            "--tinker-api-keys",
            self.tinker_api_keys,
            "keys the SDK sends (it refuses keys that do not begin tml-)",
        )
        for name in ("tinker_max_lora_rank", "tinker_max_models", "tinker_max_batch_tokens", "tinker_chunk_datums"):
            require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")


@dataclass(kw_only=True, slots=True)
class TinkerServeConfig:
    """``inverted tinker-serve``: the training service, its trainer and its rollout servers (flags of all)."""

    tinker: TinkerConfig
    train: TrainConfig
    servers: ServersConfig

    # The client owns what a job's flags say: its loss, its optimizer's settings per step, its LoRA rank and
    # modules per model, its checkpoints. One training rank (no model parallelism: one process holds every
    # model), log-probs at temperature 1. What stays a flag: the model, batching, precision, recomputation,
    # the LoRA alpha and dropout, the weight sync.
    SETS: typing.ClassVar[dict[str, dict[str, Any]]] = {
        "train": held(
            LossConfig,
            OptimConfig,
            ParallelConfig,
            CheckpointConfig,
            MoEConfig,
            plugin_args=None,
            num_rollout=1,
            debug_train_only=False,
            load_debug_rollout_data=None,
            global_batch_size=0,
            save_train_details=False,
            chat_template=None,
            lora_rank=0,
            target_modules=["all"],
            lora_adapter_path=None,
        ),
        "servers": {
            "log_dir": _SET_BY_SERVICE,
            "admin_api_key": None,
            "router_api_key": None,
            "hf_checkpoint": _SET_BY_SERVICE,
        },
    }

    def __post_init__(self) -> None:
        self.servers.hf_checkpoint = self.train.hf_checkpoint  # one flag: the servers sample the trained model
