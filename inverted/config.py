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

    A composite (``JobConfig``) adds its sections' flags, minus the fields it sets itself (``SETS``):
    one flag is one field, so a field name two parts hold is a flag of one of them, and the composite
    passes its value to the other (``JobConfig.share``).
    """
    if hasattr(section, "SETS"):
        for name, part in _parts(section).items():
            add_flags(parser, part, exclude=frozenset(section.SETS.get(name, {})))
        return
    hints = typing.get_type_hints(section)
    taken = {a.dest for a in parser._actions}
    group = parser.add_argument_group(section.__name__, (section.__doc__ or "").strip().splitlines()[0])
    for f in dataclasses.fields(section):
        if (sub := _subsection(hints[f.name])) is not None:
            add_flags(parser, sub, exclude)
            continue
        if f.name in exclude:
            continue
        if f.name in taken:  # two parts of a command with one field name: which one would the flag set?
            raise TypeError(
                f"{section.__name__}.{f.name}: {flag_name(f.name)} is already another section's flag; one flag "
                "is one field: hold it in the composite's SETS and pass it the owner's value"
            )
        default = _default(f)
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
        elif f.metadata.get("path") and value and not value.startswith(SET_BY):
            setattr(config, f.name, str(base / Path(value).expanduser()))


SET_BY = "(set by "


def set_by(command: str) -> str:
    """The placeholder of a field that ``command`` sets itself (an address, a key, a file of its run):
    it passes the section's checks until the command replaces it, and is never taken for a path."""
    return f"{SET_BY}{command})"


def json_object(text: str) -> dict[str, Any] | None:
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


def require(condition: bool, flag: str, value: Any, expected: str) -> None:
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
        require(self.max_positions >= 0, "--max-positions", self.max_positions, ">= 0")


@dataclass(kw_only=True, slots=True)
class ImportGGUFConfig:
    """A GGUF file (llama.cpp's format) as a Hugging Face checkpoint directory, checked against transformers."""

    src: str = option("", "a .gguf file, or pkg:NAME for the GGUF file an installed package ships", positional=True)
    out: str = option("", "directory to write the checkpoint into (must not exist or be empty)", path=True)
    dtype: Literal["float32", "bfloat16"] = option("float32", "dtype of the written weights")

    def __post_init__(self) -> None:
        require(bool(self.src), "SRC", self.src, "a .gguf path or pkg:NAME")
        require(bool(self.out), "--out", self.out, "an output directory")


CHAT_TEMPLATE_HELP = (
    "a Jinja chat template file rendered instead of the checkpoint's own wherever chats are rendered "
    "(SGLang's --chat-template): e.g. inverted/chat_template.jinja, ChatML with Hermes-style tool "
    "calls, for SmolLM2, whose own template has no tools"
)


PLUGIN_ARGS_HELP = (
    "every flag of the job as one JSON object, from which adapters build the args of plug-ins written "
    "for other frameworks (inverted train sets it: the same in every process)"
)


def passed(section: type, *names: str) -> dict[str, Any]:
    """Fields ``names`` of ``section`` at their defaults: in a composite, fields whose flag another part
    owns; the composite passes them the owner's value (``JobConfig.share``)."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    return {name: _default(fields[name]) for name in names}


def held(*sections: type, **values: Any) -> dict[str, Any]:
    """Every field of ``sections`` at its default, and ``values``: knobs a command holds fixed, not flags."""
    return {f.name: _default(f) for section in sections for f in dataclasses.fields(section)} | values
