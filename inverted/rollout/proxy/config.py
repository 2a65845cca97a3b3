"""``inverted proxy``'s flags: the token-recording proxy's address, keys, model and recording rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inverted.config import (
    CHAT_TEMPLATE_HELP,
    CONTEXT_LENGTH_HELP,
    SAMPLING_MASK_HELP,
    SAMPLING_MASK_TOP_K,
    flag_name,
    option,
    require,
)


@dataclass(kw_only=True, slots=True)
class ProxyConfig:
    """The token-recording OpenAI-compatible proxy: sessions in front of the router's /generate."""

    router_url: str = option("", "sgl-router (or one SGLang server) whose /generate the proxy calls")
    tokenizer: str = option(
        "", "checkpoint directory whose tokenizer and chat template the proxy renders with", path=True
    )
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP, path=True)
    proxy_host: str = option("127.0.0.1", "address to bind")
    proxy_port: int = option(8700, "port to bind")
    proxy_api_key: str | None = option(None, "key required to create sessions and for session admin routes")
    router_api_key: str | None = option(None, "key the router requires on /generate (its --api-key)")
    router_admin_api_key: str | None = option(
        None,
        "key of the router's worker list (its control plane), for the calls the router would change, which go "
        "to its workers (routed experts, sampling masks)",
    )
    served_model_name: str = option("", "model id in answers and /v1/models (default: the checkpoint's folder name)")
    context_length: int = option(0, CONTEXT_LENGTH_HELP)
    lora_name: str | None = option(
        None, "LoRA adapter every call samples from (SGLang's lora_path; inverted train sets it when it trains one)"
    )
    partial_rollout: bool = option(
        False,
        "resume a call aborted by a weight update from its sampled tokens "
        "(each keeps its version) instead of sampling it again",
    )
    return_routed_experts: bool = option(
        False,
        "ask the servers for each token's routed experts (MoE; SGLang's return_routed_experts) and keep them "
        "in the Samples, for rollout routing replay (inverted train sets it with --use-rollout-routing-replay)",
    )
    proxy_max_resumes: int = option(8, "aborts one call may survive before it fails with 503")
    proxy_server_loss_wait: float = option(
        180.0, "seconds a call goes on trying after its server died or none answered (the job replaces dead ones)"
    )
    proxy_max_turns: int = option(0, "turns per session (0: no limit); more get 409")
    proxy_max_sessions: int = option(
        16384,
        "sessions held at once, open or finished and kept for --proxy-retention; when full, the oldest "
        "finished ones are forgotten first, and with only open ones left a new session gets 429",
    )
    proxy_max_session_tokens: int = option(
        1 << 20, "tokens one session may record over all its branches; a call past it gets 400"
    )
    proxy_max_request_bytes: int = option(32 * 1024**2, "largest request body accepted (larger ones get 413 unread)")
    proxy_max_session_metadata_bytes: int = option(
        1024**2,
        "largest metadata (with its sample template) a session may be opened with, as JSON: a session "
        "keeps it in every Sample it makes",
    )
    proxy_session_timeout: float = option(1800.0, "seconds idle before a session is finished (its samples are kept)")
    proxy_retention: float = option(3600.0, "seconds a finished session's samples stay readable")
    proxy_replay_retries: Literal["off", "header", "always"] = option(
        "header",
        "answer a repeated identical call from the record: never, when the SDK marks it a retry "
        "(x-stainless-retry-count), or always",
    )
    proxy_tool_parser_path: str = option(
        "inverted.rollout.chat:HermesToolParser", "module:Class() -> parser with .start and .parse(text) for tool calls"
    )
    proxy_hosted_tools: list[str] = option(
        [],
        "hosted tools the proxy runs itself inside a call (Responses' web_search, Messages' web_search_2025..., "
        "Chat's web_search_options, ...), as KIND=module:function, KIND one of web_search, web_fetch, file_search, "
        "code_interpreter (e.g. web_search=envs.local_search:search); a declared kind without one is not offered "
        "to the model, and the turn says so",
    )
    proxy_generate_timeout: float = option(1800.0, "seconds one call may wait for the servers (paused ones included)")
    proxy_constrained_tokens: Literal["policy", "mask", "constrained"] = option(
        "policy",
        "tokens sampled under a json_schema or regex: record the policy's own (unconstrained) logprob, "
        "which the embedded engine reports (else they are masked); keep them out of the loss (mask); or "
        "record the constrained logprob the servers return (SGLang's; its ratio against the trainer's is off)",
    )
    sampling_mask_top_k: int = option(SAMPLING_MASK_TOP_K, SAMPLING_MASK_HELP)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")

    def __post_init__(self) -> None:
        require(bool(self.router_url), "--router-url", self.router_url, "the router's URL")
        require(
            0 <= self.sampling_mask_top_k <= 4096,
            "--sampling-mask-top-k",
            self.sampling_mask_top_k,
            "in [0, 4096] (the servers' --sampling-mask-max-tokens)",
        )
        require(bool(self.tokenizer), "--tokenizer", self.tokenizer, "a checkpoint directory")
        require(1 <= self.proxy_port <= 65535, "--proxy-port", self.proxy_port, "1..65535")
        require(self.context_length >= 0, "--context-length", self.context_length, ">= 0")
        require(self.proxy_max_resumes >= 0, "--proxy-max-resumes", self.proxy_max_resumes, ">= 0")
        require(self.proxy_server_loss_wait >= 0, "--proxy-server-loss-wait", self.proxy_server_loss_wait, ">= 0")
        require(self.proxy_max_turns >= 0, "--proxy-max-turns", self.proxy_max_turns, ">= 0")
        for name in (
            "proxy_max_sessions",
            "proxy_max_session_tokens",
            "proxy_max_request_bytes",
            "proxy_max_session_metadata_bytes",
        ):
            require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        require(self.proxy_session_timeout > 0, "--proxy-session-timeout", self.proxy_session_timeout, "> 0")
        require(self.proxy_generate_timeout > 0, "--proxy-generate-timeout", self.proxy_generate_timeout, "> 0")
