"""``inverted engine``'s flags: the embedded engine's model, batching, memory and threads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inverted.config import (
    CONTEXT_LENGTH_HELP,
    option,
    require,
)


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """The embedded engine: an SGLang-protocol inference server in PyTorch."""

    model: str = option("", "Hugging Face checkpoint directory (config.json, safetensors, tokenizer)", path=True)
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(30000, "port to bind")
    device: Literal["cpu", "cuda"] = option("cpu", "device to run on")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "weight and activation dtype (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    max_running_requests: int = option(64, "requests decoded together in one batch")
    max_queued_requests: int = option(
        4096,
        "requests waiting beyond --max-running-requests (SGLang's flag): a request that would queue more gets "
        "503, one that asks for more sequences (prompts x n) than running + queued gets 400",
    )
    context_length: int = option(0, CONTEXT_LENGTH_HELP)
    max_prefill_tokens: int = option(2048, "prompt tokens prefilled per scheduler step before decoding again")
    max_total_tokens: int = option(
        0,
        "KV-cache positions over all running requests, SGLang's --max-total-tokens (0: what a quarter of this "
        "machine's memory holds, and at least one whole context); requests wait for room, and long ones run "
        "with fewer beside them",
    )
    disable_radix_cache: bool = option(False, "do not reuse the KV of earlier requests that share a prompt prefix")
    weight_version: str = option("default", "initial weight version, echoed in meta_info")
    served_model_name: str = option("", "model id reported to clients (default: the model path)")
    api_key: str | None = option(
        None,
        "require 'Authorization: Bearer KEY' on every route but the probes (/health, /health_generate, "
        "/ready) and /metrics, which stay open as SGLang leaves them, for load balancers and scrapers",
    )
    admin_api_key: str | None = option(None, "key for control and weight routes (then api_key is not accepted there)")
    num_threads: int = option(0, "torch CPU threads (0: all cores)")
    stored_copy_rows: int = option(
        -1,
        "on a CPU in float32, also hold every packed weight matrix as stored and multiply steps of up to this "
        "many rows through it, split in one block of output rows per thread (on some CPUs it streams faster "
        "than oneDNN's packed layout), for the matrices' memory again; -1: measured at load (up to 4 rows, "
        "0 where it does not pay by 10 %)",
    )
    random_seed: int | None = option(
        None, "seed for requests without sampling_seed (default: fresh per process, so engines differ)"
    )
    log_requests: bool = option(
        False, "log every finished request (input ids, output ids, finish reason) as a JSON line"
    )
    max_request_bytes: int = option(64 * 1024**2, "largest request body accepted (larger ones get 413 unread)")
    weight_update_timeout: float = option(
        300.0,
        "seconds to wait for the trainer: joining a weight-update group, taking a broadcast, or between the "
        "calls of an update session (an idle session is then ended, so a dead trainer cannot stop generation)",
    )
    enable_lora: bool = option(False, "serve LoRA adapters (SGLang's LoRA routes, and lora_path on /generate)")
    max_lora_rank: int = option(0, "largest adapter rank accepted (0: the largest of --lora-paths)")
    lora_target_modules: list[str] = option(
        [],
        "modules adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(default: those of --lora-paths, else all)",
    )
    max_loras_per_batch: int = option(8, "distinct adapters running at once (more wait their turn)")
    max_loaded_loras: int | None = option(None, "adapters held at once (default: no limit)")
    lora_paths: list[str] = option(
        [], "adapters to load at startup, as NAME=PATH (PEFT directories); implies --enable-lora"
    )
    enable_return_routed_experts: bool = option(
        False, "keep each token's routed experts (MoE models) so /generate can return them (return_routed_experts)"
    )
    sampling_mask_max_tokens: int = option(
        4096,
        "largest sampling mask /generate returns (return_sampling_mask): a request asking for one needs "
        "top_k 1 or in (1, this] (SGLang's flag and default)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")

    def __post_init__(self) -> None:
        require(bool(self.model), "--model", self.model, "a checkpoint directory")
        require(self.sampling_mask_max_tokens > 0, "--sampling-mask-max-tokens", self.sampling_mask_max_tokens, "> 0")
        require(self.max_lora_rank >= 0, "--max-lora-rank", self.max_lora_rank, ">= 0")
        require(self.max_loras_per_batch >= 1, "--max-loras-per-batch", self.max_loras_per_batch, ">= 1")
        require(
            self.max_loaded_loras is None or self.max_loaded_loras >= 1,
            "--max-loaded-loras",
            self.max_loaded_loras,
            ">= 1",
        )
        self.enable_lora = self.enable_lora or bool(self.lora_paths)
        require(self.weight_update_timeout > 0, "--weight-update-timeout", self.weight_update_timeout, "> 0")
        require(1 <= self.port <= 65535, "--port", self.port, "1..65535")
        require(self.max_running_requests >= 1, "--max-running-requests", self.max_running_requests, ">= 1")
        require(self.max_queued_requests >= 0, "--max-queued-requests", self.max_queued_requests, ">= 0")
        require(self.context_length >= 0, "--context-length", self.context_length, ">= 0")
        require(self.max_prefill_tokens >= 1, "--max-prefill-tokens", self.max_prefill_tokens, ">= 1")
        require(self.max_total_tokens >= 0, "--max-total-tokens", self.max_total_tokens, ">= 0")
        require(self.num_threads >= 0, "--num-threads", self.num_threads, ">= 0")
        require(self.stored_copy_rows >= -1, "--stored-copy-rows", self.stored_copy_rows, ">= -1")
        require(self.max_request_bytes >= 1, "--max-request-bytes", self.max_request_bytes, ">= 1")
