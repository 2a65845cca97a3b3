"""Typed configuration: section dataclasses whose fields generate the command-line flags.

Every knob is a field with a type, a default and a one-line help (``option``). ``add_flags`` turns a
section into argparse flags (``max_running_requests`` becomes ``--max-running-requests``) and
``build_section`` turns parsed flags back into the section, whose ``__post_init__`` checks single
fields. A section may hold sections of its own (``TrainConfig``'s ``loss``, ``optim``, ``parallel``,
``sync``, ``ckpt``), each handed whole to the component that owns it; their flags stay flat (``--lr``,
not ``--optim-lr``), so ``from_flags`` builds any section from flag names and ``to_flags`` flattens one
back (for YAML and slime's ``args``). ``--config FILE.yaml`` supplies the same keys; flags override it.
Flags that start with a pass-through prefix (``--sglang-``, ``--router-``) are not modelled:
``split_passthrough`` hands them verbatim to the process they belong to. Fields that name files
(``option(..., path=True)``) are made absolute by ``resolve_paths`` once, at start-up, against the
user's working directory.

This module imports only ``errors`` and ``types``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from inverted.errors import ConfigError
from inverted.types import PauseMode


def option(default: Any, help: str, **extra: Any) -> Any:
    """A config field with its one-line help; ``extra`` goes to argparse (e.g. ``metavar``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _argparse_kwargs(tp: Any) -> dict[str, Any]:
    """argparse keyword arguments for a field type: str, int, float, bool, Literal, list, Optional."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {tp}")
        return _argparse_kwargs(inner[0])
    if origin is Literal:
        choices = list(typing.get_args(tp))
        return {"type": type(choices[0]), "choices": choices}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": item, "nargs": "*"}
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if tp in (str, int, float):
        return {"type": tp}
    raise TypeError(f"unsupported config field type {tp}")


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def _subsection(tp: Any) -> type | None:
    """The section type of a field that holds a section (a dataclass), else None."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def from_flags(section: type, values: dict[str, Any] | argparse.Namespace | None = None, **more: Any) -> Any:
    """``section`` built from flag-named values (nested sections too); missing ones take their defaults."""
    given = {**(vars(values) if isinstance(values, argparse.Namespace) else values or {}), **more}
    hints = typing.get_type_hints(section)
    kwargs = {}
    for f in dataclasses.fields(section):
        if (sub := _subsection(hints[f.name])) is not None:
            kwargs[f.name] = from_flags(sub, given)
        elif f.name in given:
            kwargs[f.name] = given[f.name]
    built = section(**kwargs)
    if unknown := set(more) - set(to_flags(built)):
        raise TypeError(f"{section.__name__} has no field(s) {sorted(unknown)}")
    return built


def to_flags(config: Any) -> dict[str, Any]:
    """A section's values by flag name, its nested sections flattened into it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out.update(to_flags(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


def plugin_flags(*sections: Any) -> dict[str, Any]:
    """Every flag of the job by name, as adapters of other frameworks' plug-ins read them (their
    ``args``): the job's whole namespace where a section carries it (``plugin_args``, which
    ``inverted train`` sets), then the sections' own flags for what it lacks."""
    values: dict[str, Any] = {}
    for section in sections:
        values |= json.loads(getattr(section, "plugin_args", None) or "{}")
    for section in sections:
        values |= {k: v for k, v in to_flags(section).items() if k != "plugin_args" and k not in values}
    return values


def _parts(composite: type) -> dict[str, type]:
    """The sections of a composite config (a dataclass whose fields are sections), by field name."""
    hints = typing.get_type_hints(composite)
    return {f.name: hints[f.name] for f in dataclasses.fields(composite)}


def add_flags(parser: argparse.ArgumentParser, section: type, exclude: frozenset[str] = frozenset()) -> None:
    """Add one flag per field of ``section`` to ``parser`` (generic; no per-flag code).

    A composite (``JobConfig``) adds its sections' flags, minus the fields it sets itself. A field
    that two sections share (``--hf-checkpoint``) is one flag: the same name means the same thing.
    """
    if hasattr(section, "SETS"):
        for name, part in _parts(section).items():
            add_flags(parser, part, exclude=frozenset(section.SETS.get(name, {})))
        return
    hints = typing.get_type_hints(section)
    taken = {a.dest: a.default for a in parser._actions}
    group = parser.add_argument_group(section.__name__, (section.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(section):
        if (sub := _subsection(hints[f.name])) is not None:
            add_flags(parser, sub, exclude)
            continue
        if f.name in exclude:
            continue
        default = _default(f)
        if f.name in taken:
            if taken[f.name] != default:
                raise TypeError(f"{section.__name__}.{f.name}: shared flag with a different default")
            continue
        meta = dict(f.metadata)
        help_text = meta.pop("help", "")
        meta.pop("path", None)
        # A positional field (import-gguf's SRC) is still optional to argparse, so --config can supply it.
        names: tuple[tuple[str], dict[str, Any]] = (
            ((f.name,), {"metavar": f.name.upper(), "nargs": "?"})
            if meta.pop("positional", False)
            else ((flag_name(f.name),), {"dest": f.name})
        )
        group.add_argument(
            *names[0],
            **names[1],
            default=default,
            help=f"{help_text} (default: {default!r})",
            **_argparse_kwargs(hints[f.name]),
            **meta,
        )


def build_section(section: type, namespace: argparse.Namespace) -> Any:
    """Build ``section`` from parsed flags; field checks in ``__post_init__`` raise ConfigError."""
    if hasattr(section, "SETS"):
        return section(
            **{
                name: from_flags(part, namespace, **section.SETS.get(name, {}))
                for name, part in _parts(section).items()
            }
        )
    return from_flags(section, namespace)


def read_yaml_mapping(path: str, flag: str) -> dict[str, Any]:
    """The YAML mapping in ``path`` (given by ``flag``), its keys as strings; a ``ConfigError`` otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: expected a mapping of flag names to values")
    return {str(k): v for k, v in data.items()}


def load_yaml_defaults(parser: argparse.ArgumentParser, path: str | None) -> None:
    """Make the keys of a YAML file the parser's defaults, so that explicit flags override it."""
    if not path:
        return
    data = read_yaml_mapping(path, "--config")
    known = {a.dest for a in parser._actions}
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--config {path}: unknown keys {unknown}")
    parser.set_defaults(**values)


def split_passthrough(
    argv: list[str], prefix: str, own: set[str] | frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """Split ``--{prefix}-x v`` flags from argv; return (rest, ['--x', 'v', ...]) for the child.

    Flags in ``own`` (e.g. ``--router-port``, which the launcher itself must know) stay in ``rest``.
    """
    rest: list[str] = []
    passed: list[str] = []
    marker = f"--{prefix}-"
    taking = False
    for arg in argv:
        if arg.startswith(marker) and arg.split("=", 1)[0] not in own:
            passed.append("--" + arg[len(marker) :])
            taking = "=" not in arg
        elif taking and not arg.startswith("--"):
            passed.append(arg)
        else:
            taking = False
            rest.append(arg)
    return rest, passed


def resolve_paths(config: Any, base: Path | None = None) -> None:
    """Make every path field (``option(..., path=True)``) of ``config`` absolute against ``base`` (the
    working directory), nested sections too: once, at start-up, so that a process started elsewhere
    (a Ray actor, a service in its own directory) reads the file the user named."""
    base = base or Path.cwd()
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            resolve_paths(value, base)
        elif f.metadata.get("path") and value and value != _SET_BY_JOB:
            setattr(config, f.name, str(base / Path(value).expanduser()))


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


CONTEXT_LENGTH_HELP = (
    "longest prompt + completion of one request, the same for the rollout servers and the proxy "
    "(0: the model's own, its max_position_embeddings, as SGLang's default); a call without "
    "max_tokens gets the room its prompt leaves"
)


SAMPLING_MASK_TOP_K = 512
SAMPLING_MASK_HELP = (
    "record the set each token was sampled from under top-p, top-k or min-p (SGLang's sampling "
    "mask) for the trainer to replay, and send this top_k with a call that names none (SGLang "
    "returns masks only under a finite top_k: tokens past this many most likely are not sampled); "
    "0: record none, and the importance ratios under a cut distribution are biased"
)


def _require(condition: bool, flag: str, value: Any, expected: str) -> None:
    if not condition:
        raise ConfigError(f"{flag}={value!r}: expected {expected}")


@dataclass(kw_only=True, slots=True)
class TinyModelConfig:
    """A random-initialized checkpoint in Hugging Face format, made locally (no download)."""

    out: str = option("models/tiny", "directory to write the checkpoint into", path=True)
    arch: Literal["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe"] = option(
        "qwen2",
        "model architecture (qwen3_moe, qwen2_moe: Mixture-of-Experts, 8 experts with 2 per token; "
        "qwen2_moe adds a gated shared expert)",
    )
    preset: Literal["tiny", "small", "base", "large"] = option(
        "tiny",
        "size: tiny (~0.2M) for unit tests, small (~14M) for demos and CPU benchmarks, base (~0.5B) and "
        "large (~1.3B) for GPUs",
    )
    seed: int = option(0, "random seed: the same seed gives byte-identical files")
    max_positions: int = option(
        0,
        "context length (max_position_embeddings); 0 keeps the preset's 4,096. Coding-agent harnesses open with "
        "prompts of 10,000 to 30,000 tokens: 65536 serves them",
    )

    def __post_init__(self) -> None:
        _require(self.max_positions >= 0, "--max-positions", self.max_positions, ">= 0")


@dataclass(kw_only=True, slots=True)
class ImportGGUFConfig:
    """A GGUF file (llama.cpp's format) as a Hugging Face checkpoint directory, checked against transformers."""

    src: str = option("", "a .gguf file, or pkg:NAME for the GGUF file an installed package ships", positional=True)
    out: str = option("", "directory to write the checkpoint into (must not exist or be empty)", path=True)
    dtype: Literal["float32", "bfloat16"] = option("float32", "dtype of the written weights")

    def __post_init__(self) -> None:
        _require(bool(self.src), "SRC", self.src, "a .gguf path or pkg:NAME")
        _require(bool(self.out), "--out", self.out, "an output directory")


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
        _require(bool(self.model), "--model", self.model, "a checkpoint directory")
        _require(self.sampling_mask_max_tokens > 0, "--sampling-mask-max-tokens", self.sampling_mask_max_tokens, "> 0")
        _require(self.max_lora_rank >= 0, "--max-lora-rank", self.max_lora_rank, ">= 0")
        _require(self.max_loras_per_batch >= 1, "--max-loras-per-batch", self.max_loras_per_batch, ">= 1")
        _require(
            self.max_loaded_loras is None or self.max_loaded_loras >= 1,
            "--max-loaded-loras",
            self.max_loaded_loras,
            ">= 1",
        )
        self.enable_lora = self.enable_lora or bool(self.lora_paths)
        _require(self.weight_update_timeout > 0, "--weight-update-timeout", self.weight_update_timeout, "> 0")
        _require(1 <= self.port <= 65535, "--port", self.port, "1..65535")
        _require(self.max_running_requests >= 1, "--max-running-requests", self.max_running_requests, ">= 1")
        _require(self.max_queued_requests >= 0, "--max-queued-requests", self.max_queued_requests, ">= 0")
        _require(self.context_length >= 0, "--context-length", self.context_length, ">= 0")
        _require(self.max_prefill_tokens >= 1, "--max-prefill-tokens", self.max_prefill_tokens, ">= 1")
        _require(self.max_total_tokens >= 0, "--max-total-tokens", self.max_total_tokens, ">= 0")
        _require(self.num_threads >= 0, "--num-threads", self.num_threads, ">= 0")
        _require(self.max_request_bytes >= 1, "--max-request-bytes", self.max_request_bytes, ">= 1")


CHAT_TEMPLATE_HELP = (
    "a Jinja chat template file rendered instead of the checkpoint's own wherever chats are rendered "
    "(SGLang's --chat-template): e.g. inverted/chat_template.jinja, ChatML with Hermes-style tool "
    "calls, for SmolLM2, whose own template has no tools"
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
    engine_max_running_requests: int = option(64, "--max-running-requests of each engine")
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
        _require(bool(self.hf_checkpoint), "--hf-checkpoint", self.hf_checkpoint, "a checkpoint directory")
        _require(
            not self.chat_template or Path(self.chat_template).is_file(),
            "--chat-template",
            self.chat_template,
            "a Jinja template file",
        )
        _require(self.num_engines >= 1, "--num-engines", self.num_engines, ">= 1")
        _require(self.max_total_tokens >= 0, "--max-total-tokens", self.max_total_tokens, ">= 0")
        _require(
            self.rollout_num_gpus_per_engine >= 1,
            "--rollout-num-gpus-per-engine",
            self.rollout_num_gpus_per_engine,
            ">= 1",
        )
        _require(
            self.rollout_num_gpus % self.rollout_num_gpus_per_engine == 0,
            "--rollout-num-gpus",
            self.rollout_num_gpus,
            "a multiple of --rollout-num-gpus-per-engine",
        )
        if self.rollout_num_gpus:
            self.num_engines = self.rollout_num_gpus // self.rollout_num_gpus_per_engine
        _require(0 <= self.router_port <= 65535, "--router-port", self.router_port, "0..65535")
        _require(self.startup_timeout > 0, "--startup-timeout", self.startup_timeout, "> 0")


PLUGIN_ARGS_HELP = (
    "every flag of the job as one JSON object, from which adapters build the args of plug-ins written "
    "for other frameworks (inverted train sets it: the same in every process)"
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
        _require(1 <= self.port <= 65535, "--port", self.port, "1..65535")
        _require(self.n_samples_per_prompt >= 1, "--n-samples-per-prompt", self.n_samples_per_prompt, ">= 1")
        _require(self.num_epoch >= 0, "--num-epoch", self.num_epoch, ">= 0")
        _require(self.lease_seconds > 0, "--lease-seconds", self.lease_seconds, "> 0")
        _require(self.workers >= 1, "--workers", self.workers, ">= 1")
        _require(
            self.buffer_max_request_bytes >= 1, "--buffer-max-request-bytes", self.buffer_max_request_bytes, ">= 1"
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
        _require(bool(self.router_url), "--router-url", self.router_url, "the router's URL")
        _require(
            0 <= self.sampling_mask_top_k <= 4096,
            "--sampling-mask-top-k",
            self.sampling_mask_top_k,
            "in [0, 4096] (the servers' --sampling-mask-max-tokens)",
        )
        _require(bool(self.tokenizer), "--tokenizer", self.tokenizer, "a checkpoint directory")
        _require(1 <= self.proxy_port <= 65535, "--proxy-port", self.proxy_port, "1..65535")
        _require(self.context_length >= 0, "--context-length", self.context_length, ">= 0")
        _require(self.proxy_max_resumes >= 0, "--proxy-max-resumes", self.proxy_max_resumes, ">= 0")
        _require(self.proxy_server_loss_wait >= 0, "--proxy-server-loss-wait", self.proxy_server_loss_wait, ">= 0")
        _require(self.proxy_max_turns >= 0, "--proxy-max-turns", self.proxy_max_turns, ">= 0")
        for name in (
            "proxy_max_sessions",
            "proxy_max_session_tokens",
            "proxy_max_request_bytes",
            "proxy_max_session_metadata_bytes",
        ):
            _require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        _require(self.proxy_session_timeout > 0, "--proxy-session-timeout", self.proxy_session_timeout, "> 0")
        _require(self.proxy_generate_timeout > 0, "--proxy-generate-timeout", self.proxy_generate_timeout, "> 0")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The RL objective: advantages, the surrogate and its clipping, KL, entropy and importance weights."""

    advantage_estimator: Literal["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        option("grpo", "how rewards become per-token advantages, and which surrogate is optimised")
    )
    disable_grpo_std_normalization: bool = option(
        False, "group advantages are reward - mean, not divided by std (Dr. GRPO)"
    )
    gamma: float = option(1.0, "discount of the reinforce_plus_plus returns")
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = option(
        "token_mean", "how per-token losses become one number (seq_mean_token_sum: Dr. GRPO)"
    )
    eps_clip: float = option(0.2, "PPO clip range below 1")
    eps_clip_high: float | None = option(None, "PPO clip range above 1 (default: --eps-clip; DAPO's clip-higher)")
    eps_clip_c: float | None = option(None, "dual-clip bound (> 1) on the loss of negative-advantage tokens")
    use_kl_loss: bool = option(False, "add a KL-to-reference term to the loss")
    kl_loss_coef: float = option(0.0, "weight of the KL loss")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = option("low_var_kl", "KL estimator")
    kl_coef: float = option(0.0, "KL to the reference as a reward penalty (k1, per token)")
    entropy_coef: float = option(0.0, "weight of the entropy bonus")
    use_tis: bool = option(False, "truncated importance sampling with the rollout log-probs")
    tis_clip: float = option(2.0, "upper clip of the TIS weight")
    tis_clip_low: float = option(0.0, "lower clip of the TIS weight")
    mask_offpolicy_in_partial_rollout: bool = option(
        False,
        "leave out of the loss the tokens of a sample that older weights sampled before its last weight "
        "update (a partial rollout trains only on its newest policy's tokens)",
    )
    rollout_temperature: float = option(1.0, "sampling temperature; training log-probs use the same")
    reward_key: str | None = option(None, "key of a dict reward to train on (default: the sum of its values)")
    loss_type: Literal["policy_loss", "custom_loss", "sft_loss"] = option(
        "policy_loss",
        "the RL surrogate above, --custom-loss-function-path's loss (slime's custom_loss), or the "
        "negative log-likelihood of the trained tokens (slime's sft_loss, e.g. with "
        "slime.rollout.sft_rollout)",
    )
    custom_loss_function_path: str | None = option(
        None,
        "module:function(args, batch, logits, sum_of_sample_mean) -> (loss, metrics), with --loss-type custom_loss",
    )
    custom_tis_function_path: str | None = option(
        None,
        "module:function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kw) -> "
        "(pg_loss, loss_masks, metrics): importance weights in place of --use-tis's (turns TIS on)",
    )
    custom_pg_loss_reducer_function_path: str | None = option(
        None,
        "module:get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> "
        "reducer: how the policy-gradient term is reduced (e.g. Dr. GRPO's constant divisor)",
    )
    custom_reward_post_process_path: str | None = option(
        None,
        "module:function(samples) -> rewards (slime's (args, samples) -> (raw_rewards, rewards)): the rewards "
        "that become advantages, in place of the group normalisation",
    )
    raw_rewards: bool = option(
        False,
        "advantages from the rewards as they are, with no group baseline (slime's --disable-rewards-normalization)",
    )
    per_token_loss: bool = option(
        False,
        "a custom pg-loss reducer's value is divided by the step's trained tokens "
        "instead of its samples, as Megatron's per-token loss (slime's "
        "--calculate-per-token-loss)",
    )
    distill: Literal["none", "samples", "teacher"] = option(
        "none",
        "on-policy distillation: each token's advantage loses --distill-kl-coef x (its old log-prob - the "
        "teacher's); the teacher's log-probs come with the Samples (teacher_log_probs, which a reward "
        "post-process sets), or from --distill-teacher, which the trainer runs (slime's --use-opd)",
    )
    distill_teacher: str | None = option(
        None, "the teacher's HF checkpoint for --distill teacher, of the policy's architecture", path=True
    )
    distill_kl_coef: float = option(1.0, "the weight of on-policy distillation's reverse KL in the advantages")

    def __post_init__(self) -> None:
        _require(
            self.loss_type != "custom_loss" or bool(self.custom_loss_function_path),
            "--custom-loss-function-path",
            self.custom_loss_function_path,
            "a module:function with --loss-type custom_loss",
        )
        _require(0 < self.eps_clip, "--eps-clip", self.eps_clip, "> 0")
        _require(self.eps_clip_high is None or self.eps_clip_high > 0, "--eps-clip-high", self.eps_clip_high, "> 0")
        _require(self.eps_clip_c is None or self.eps_clip_c > 1, "--eps-clip-c", self.eps_clip_c, "> 1")
        _require(self.rollout_temperature > 0, "--rollout-temperature", self.rollout_temperature, "> 0")
        _require(0 <= self.tis_clip_low <= self.tis_clip, "--tis-clip-low", self.tis_clip_low, "0 <= it <= --tis-clip")
        _require(
            not (self.kl_coef and self.use_kl_loss and self.kl_loss_coef),
            "--kl-coef",
            self.kl_coef,
            "0 when --use-kl-loss has a non-zero --kl-loss-coef (KL as reward or as loss, not both)",
        )
        _require(
            (self.distill == "teacher") == bool(self.distill_teacher),
            "--distill-teacher",
            self.distill_teacher,
            "a checkpoint exactly when --distill teacher",
        )

    @property
    def needs_reference(self) -> bool:
        return bool(self.kl_coef) or (self.use_kl_loss and bool(self.kl_loss_coef))


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """The optimizer: AdamW through Megatron's optimizer wrapper, with gradient clipping."""

    lr: float = option(1e-6, "learning rate (constant)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta1: float = option(0.9, "AdamW beta1")
    adam_beta2: float = option(0.98, "AdamW beta2")
    adam_eps: float = option(1e-8, "AdamW epsilon")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0: no clipping)")
    use_distributed_optimizer: bool = option(False, "shard optimizer state over data-parallel ranks (GPU only)")

    def __post_init__(self) -> None:
        _require(self.lr >= 0, "--lr", self.lr, ">= 0")


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the trainer is laid out: Megatron's parallel sizes over nodes x processes per node."""

    tensor_model_parallel_size: int = option(1, "Megatron tensor parallelism")
    pipeline_model_parallel_size: int = option(1, "Megatron pipeline parallelism")
    context_parallel_size: int = option(1, "Megatron context parallelism")
    expert_model_parallel_size: int = option(1, "Megatron expert parallelism")
    sequence_parallel: bool = option(
        False,
        "Megatron sequence parallelism: tensor-parallel ranks split the sequence outside attention and the "
        "MLP (less activation memory; needed to tensor-parallelise a Mixture-of-Experts model)",
    )
    actor_num_nodes: int = option(1, "training nodes")
    actor_num_gpus_per_node: int = option(1, "training processes per node (GPUs; CPU processes without CUDA)")
    actor_node_resource: str | None = option(
        None, "a Ray custom resource (ray start --resources) that only the training nodes offer: the ranks go there"
    )

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "actor_num_nodes",
            "actor_num_gpus_per_node",
        ):
            _require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")

    def validate(self) -> None:
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        _require(
            self.world_size % model_parallel == 0,
            "--actor-num-gpus-per-node",
            self.actor_num_gpus_per_node,
            f"a multiple of tensor x pipeline x context parallel sizes ({model_parallel}) over "
            f"{self.actor_num_nodes} node(s)",
        )

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How new weights reach the rollout servers after a training step."""

    update_weight_transport: Literal["auto", "tensor", "distributed", "disk"] = option(
        "auto", "how new weights reach the rollout servers (auto: tensor when they are on this node, else distributed)"
    )
    update_weight_buffer_size: int = option(
        0,
        "bytes per flattened weight bucket (0: 512 MiB on a GPU, slime's default; 128 MiB on a CPU, where the "
        "buckets are host memory that the trainer and the engines keep mapped between updates)",
    )
    update_weight_disk_dir: str | None = option(
        None,
        "where the disk transport writes weights (default: OUTPUT_DIR/weight_updates; shared storage across nodes)",
        path=True,
    )
    update_weight_timeout: float = option(300.0, "seconds to wait for the servers to join a weight-update group")
    pause_mode: PauseMode = option(
        "retract",
        "how generation pauses for a weight update: abort in-flight requests, retract them (resumed on "
        "the new weights, KV recomputed) or hold them in place",
    )

    def __post_init__(self) -> None:
        _require(
            self.update_weight_buffer_size == 0 or self.update_weight_buffer_size >= 1024**2,
            "--update-weight-buffer-size",
            self.update_weight_buffer_size,
            "0 (the device's default) or >= 1 MiB",
        )
        _require(self.update_weight_timeout > 0, "--update-weight-timeout", self.update_weight_timeout, "> 0")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Training checkpoints: where to resume from, where and how often to save."""

    load: str | None = option(
        None, "checkpoint directory to resume from (its latest step); overrides the HF weights", path=True
    )
    save: str | None = option(None, "directory to write checkpoints into", path=True)
    save_interval: int = option(0, "save every N rollouts (0: only at the end, when --save is set)")
    restart_save_interval: int = option(
        1,
        "keep the trainer's own state every N rollouts in OUTPUT_DIR/restart (the latest only, written while "
        "episodes run), from which a trainer whose rank died restarts; 0: none (it restarts from the last --save "
        "checkpoint, or the start, and trains again every batch since)",
    )

    def __post_init__(self) -> None:
        _require(self.save_interval >= 0, "--save-interval", self.save_interval, ">= 0")
        _require(self.restart_save_interval >= 0, "--restart-save-interval", self.restart_save_interval, ">= 0")


@dataclass(kw_only=True, slots=True)
class AdapterConfig:
    """LoRA: train a low-rank adapter on frozen base weights, and sync only the adapter (miles' flags)."""

    lora_rank: int = option(0, "LoRA rank (0: full fine-tuning)")
    lora_alpha: float = option(32.0, "LoRA alpha: the adapter's output is scaled by alpha / rank")
    lora_dropout: float = option(0.0, "dropout on the adapter's input")
    target_modules: list[str] = option(
        ["all"], "modules to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all"
    )
    lora_adapter_path: str | None = option(
        None, "PEFT adapter directory to start from (its own rank, alpha and modules are used)", path=True
    )

    def __post_init__(self) -> None:
        _require(self.lora_rank >= 0, "--lora-rank", self.lora_rank, ">= 0")
        _require(self.lora_alpha > 0, "--lora-alpha", self.lora_alpha, "> 0")
        _require(0 <= self.lora_dropout < 1, "--lora-dropout", self.lora_dropout, "in [0, 1)")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0 or bool(self.lora_adapter_path)


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Mixture-of-Experts training: Megatron's load-balancing loss, and routing replay (slime's flags)."""

    moe_aux_loss_coeff: float = option(
        0.0, "weight of Megatron's load-balancing loss (aux_loss), added per MoE layer; reported as train/moe_aux_loss"
    )
    use_rollout_routing_replay: bool = option(
        False,
        "R3: the rollout servers return each token's routed experts, the Samples keep them, and the trainer's "
        "routers send every token to those experts (the gate weights over them are the trainer's own)",
    )
    use_routing_replay: bool = option(
        False,
        "R2: the trainer's forward for the old log-probs records its routing, and every training forward "
        "of the rollout replays it",
    )

    def __post_init__(self) -> None:
        _require(self.moe_aux_loss_coeff >= 0, "--moe-aux-loss-coeff", self.moe_aux_loss_coeff, ">= 0")
        _require(
            not (self.use_rollout_routing_replay and self.use_routing_replay),
            "--use-routing-replay",
            True,
            "not together with --use-rollout-routing-replay (which replays the rollout's routing instead)",
        )

    @property
    def routing_replay(self) -> bool:
        return self.use_rollout_routing_replay or self.use_routing_replay


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The Megatron trainer: model, batching and precision here; loss, optimizer, parallelism, weight
    sync and checkpoints in sections of their own, each handed to its owner (flags stay flat)."""

    hf_checkpoint: str = option("", "Hugging Face checkpoint the policy (and the KL reference) starts from", path=True)
    chat_template: str | None = option(None, CHAT_TEMPLATE_HELP, path=True)  # checkpoints keep it: export-hf ships it
    output_dir: str = option(
        "runs/train", "run directory: metrics.jsonl, TensorBoard events, the resolved config", path=True
    )
    num_rollout: int = option(1, "rollouts to train on")
    debug_train_only: bool = option(False, "train from --load-debug-rollout-data with no rollout servers")
    load_debug_rollout_data: str | None = option(
        None,
        "jsonl of Samples to train on (one per line), or slime's .pt dump; '{rollout_id}' in the path picks a "
        "file per rollout",
        path=True,
    )
    global_batch_size: int = option(0, "samples per optimizer step (0: the whole rollout batch in one step)")
    max_tokens_per_gpu: int = option(4096, "token budget of one packed micro-batch")
    logprob_chunk_size: int = option(
        1024,
        "tokens whose logits exist at once when the loss takes log-probs: the output layer and the softmax run "
        "chunk by chunk, recomputed in backward (0: the whole micro-batch's logits at once; a --custom-loss-"
        "function-path plug-in, which reads them, always gets them)",
    )
    recompute_granularity: Literal["auto", "none", "full", "selective"] = option(
        "auto",
        "activation recomputation (Megatron's): 'full' keeps only each recomputed layer's input for backward, "
        "'selective' recomputes its core attention; 'auto': 'full' for a dense model trained on the CPU (where "
        "it costs no measurable step time), else 'none'",
    )
    recompute_method: Literal["uniform", "block"] = option(
        "uniform",
        "with 'full': 'uniform' recomputes every layer in groups of --recompute-num-layers, 'block' only "
        "the first --recompute-num-layers layers of each pipeline stage (less memory saved, less time spent)",
    )
    recompute_num_layers: int = option(1, "layers per recomputed group ('uniform') or recomputed layers ('block')")
    seed: int = option(1234, "random seed")
    bf16: bool = option(False, "train in bfloat16 (GPU); fp32 otherwise")
    save_train_details: bool = option(
        True,
        "keep each trained Sample's recomputed log-probs and advantages in OUTPUT_DIR/train_details.db "
        "(for inverted view)",
    )
    plugin_args: str | None = option(None, PLUGIN_ARGS_HELP)
    log_level: Literal["debug", "info", "warning", "error"] = option("info", "log level")
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: AdapterConfig = field(default_factory=AdapterConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        _require(bool(self.hf_checkpoint), "--hf-checkpoint", self.hf_checkpoint, "a checkpoint directory")
        for name in ("num_rollout", "max_tokens_per_gpu", "recompute_num_layers"):
            _require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        _require(self.logprob_chunk_size >= 0, "--logprob-chunk-size", self.logprob_chunk_size, ">= 0")
        _require(self.global_batch_size >= 0, "--global-batch-size", self.global_batch_size, ">= 0")

    def validate(self) -> None:
        """Cross-field checks that need the run's mode."""
        _require(
            not self.debug_train_only or bool(self.load_debug_rollout_data),
            "--load-debug-rollout-data",
            self.load_debug_rollout_data,
            "a jsonl file of Samples with --debug-train-only",
        )
        # An adapter's product of a sequence-split input would need the gathers Megatron's linears do inside.
        _require(
            not (self.lora.enabled and self.parallel.sequence_parallel),
            "--sequence-parallel",
            True,
            "off with --lora-rank",
        )
        self.parallel.validate()


@dataclass(kw_only=True, slots=True)
class ViewConfig:
    """``inverted view``: a read-only web app over a job's output directory (runs, Samples, trajectories)."""

    run_dir: str = option(
        "", "a job's output directory (--output-dir: buffer.db, metrics.jsonl)", path=True, positional=True
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8787, "port to bind")
    api_key: str | None = option(
        None,
        "require this key (open the printed address once with ?key=KEY; default: the run's own, derived from "
        "the job's key in RUN_DIR/services)",
    )
    tokenizer: str | None = option(None, "where the token texts come from (default: the run's checkpoint)", path=True)

    def __post_init__(self) -> None:
        _require(bool(self.run_dir), "RUN_DIR", self.run_dir, "a job's output directory")
        _require(1 <= self.port <= 65535, "--port", self.port, "1..65535")


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """Turn a training checkpoint into a Hugging Face model directory."""

    checkpoint: str = option("", "checkpoint directory (written by --save)", path=True)
    out: str = option("", "directory to write the Hugging Face model into", path=True)
    merge_lora: bool = option(
        False, "a LoRA checkpoint: fold the adapter into its base model (default: a PEFT adapter)"
    )

    def __post_init__(self) -> None:
        _require(bool(self.checkpoint), "--checkpoint", self.checkpoint, "a checkpoint directory")
        _require(bool(self.out), "--out", self.out, "an output directory")


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
            _require(value is None or _json_object(value) is not None, flag_name(name), value, "a JSON object")
        _require(
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
            _require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")
        _require(
            self.eval_max_response_len is None or self.eval_max_response_len >= 1,
            "--eval-max-response-len",
            self.eval_max_response_len,
            ">= 1",
        )
        _require(0 < self.rollout_top_p <= 1, "--rollout-top-p", self.rollout_top_p, "in (0, 1]")
        _require(
            self.rollout_top_k == -1 or self.rollout_top_k >= 1, "--rollout-top-k", self.rollout_top_k, "-1 or >= 1"
        )
        _require(
            not self.sampling_mask_top_k or self.rollout_top_k <= 4096,
            "--rollout-top-k",
            self.rollout_top_k,
            "at most 4096 (the servers' --sampling-mask-max-tokens) while sampling masks are recorded",
        )
        _require(self.rollout_temperature > 0, "--rollout-temperature", self.rollout_temperature, "> 0")
        _require(self.rollout_episode_timeout > 0, "--rollout-episode-timeout", self.rollout_episode_timeout, "> 0")
        _require(self.eval_interval >= 0, "--eval-interval", self.eval_interval, ">= 0")


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
        _require(self.update_weights_interval >= 1, "--update-weights-interval", self.update_weights_interval, ">= 1")
        if self.max_weight_staleness is None and self.async_mode:
            self.max_weight_staleness = 1
        _require(
            self.max_weight_staleness is None or self.max_weight_staleness >= 0,
            "--max-weight-staleness",
            self.max_weight_staleness,
            ">= 0",
        )


_SET_BY_JOB = "(set by inverted train)"


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
    # --output-dir), so they are not flags of ``inverted train``; these values only pass the
    # sections' checks until the controller replaces them.
    SETS: typing.ClassVar[dict[str, dict[str, Any]]] = {
        "train": {"plugin_args": None},
        "buffer": {
            "db": _SET_BY_JOB,
            "host": "127.0.0.1",
            "port": 8600,
            "api_key": None,
            "workers": 1,
            "plugin_args": None,
        },
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
        },
        "servers": {"log_dir": _SET_BY_JOB, "admin_api_key": None, "router_api_key": None},
    }

    def validate(self) -> None:
        """Cross-section checks, before any process starts."""
        train, rollout = self.train, self.rollout
        train.validate()
        _require(
            not (train.debug_train_only and rollout.debug_rollout_only),
            "--debug-train-only",
            True,
            "not together with --debug-rollout-only",
        )
        if not train.debug_train_only:
            _require(
                bool(self.buffer.prompt_data), "--prompt-data", self.buffer.prompt_data, "a .jsonl or .parquet dataset"
            )
        # Without a trainer nothing trains the adapter: an untrained one is the base model.
        _require(
            not (rollout.debug_rollout_only and train.lora.lora_rank and not train.lora.lora_adapter_path),
            "--lora-rank",
            train.lora.lora_rank,
            "0 with --debug-rollout-only, unless --lora-adapter-path names the adapter to roll out with",
        )
        _require(
            not rollout.eval_interval or bool(rollout.eval_prompt_data),
            "--eval-prompt-data",
            rollout.eval_prompt_data,
            "a dataset when --eval-interval is set",
        )
        loop = self.loop
        if loop.async_mode:
            _require(
                not (loop.colocate or rollout.debug_rollout_only or train.debug_train_only),
                "--async-mode",
                True,
                "not with --colocate, --debug-rollout-only or --debug-train-only (rollout and training overlap)",
            )
        if loop.max_weight_staleness is not None:  # the servers lag the trainer by up to interval - 1 versions
            _require(
                loop.max_weight_staleness >= loop.update_weights_interval - 1,
                "--max-weight-staleness",
                loop.max_weight_staleness,
                f">= --update-weights-interval - 1 = {loop.update_weights_interval - 1}",
            )
        samples = rollout.rollout_batch_size * self.buffer.n_samples_per_prompt
        _require(
            not train.global_batch_size or samples % train.global_batch_size == 0,
            "--global-batch-size",
            train.global_batch_size,
            f"a divisor of --rollout-batch-size x --n-samples-per-prompt = {samples}",
        )


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
        _require(0 <= self.tinker_port <= 65535, "--tinker-port", self.tinker_port, "0..65535")
        _require(
            all(k.startswith(("tml-", "eyJ")) for k in self.tinker_api_keys),
            "--tinker-api-keys",
            self.tinker_api_keys,
            "keys the SDK sends (it refuses keys that do not begin tml-)",
        )
        for name in ("tinker_max_lora_rank", "tinker_max_models", "tinker_max_batch_tokens", "tinker_chunk_datums"):
            _require(getattr(self, name) >= 1, flag_name(name), getattr(self, name), ">= 1")


_SET_BY_SERVICE = "(set by inverted tinker-serve)"


def _held(*sections: type, **values: Any) -> dict[str, Any]:
    """Every field of ``sections`` at its default, and ``values``: knobs a command holds fixed, not flags."""
    return {f.name: _default(f) for section in sections for f in dataclasses.fields(section)} | values


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
        "train": _held(
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
        "servers": {"log_dir": _SET_BY_SERVICE, "admin_api_key": None, "router_api_key": None},
    }
