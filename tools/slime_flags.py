"""Regenerate ``inverted/compat/slime_flags.json``: every flag slime's ``train.py`` parses, read from
slime's own parser.

slime builds one argparse parser from Megatron-LM's ``add_megatron_arguments``, its own
``add_slime_arguments`` (``slime/utils/arguments.py``), its pre-parsed mode flags, sgl-router's
``RouterArgs.add_cli_args(use_router_prefix=True)`` and SGLang's ``ServerArgs.add_cli_args`` under
``--sglang-`` (``slime/backends/sglang_utils/arguments.py``). This script runs that very code, from
checkouts of slime and Megatron-LM and the installed ``sglang`` / ``sglang-router`` wheels, and
writes each flag's options, destination, default, arity and source. Imports those files need
that no CPU machine has (slime's GPU backends, triton, IPython, zmq) are stood in for by empty
modules: only the parser-building functions run.

    python tools/slime_flags.py SLIME_CHECKOUT MEGATRON_LM_CHECKOUT [--triton-site DIR]

A checkout may be a bare git directory (its HEAD is read).

``--triton-site``: a directory holding the ``triton`` package (``pip install --target DIR triton``),
which Megatron-LM's modules import at module level.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "inverted" / "compat" / "slime_flags.json"


class _Anything:
    """An attribute of a stood-in module: a class that any call, decorator or attribute accepts."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty packages for the named top-level modules (and everything under them)."""

    def __init__(self, roots: set[str], keep: set[str] = frozenset()) -> None:
        self.roots, self.keep = roots, keep

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots and name not in self.keep:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attr(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (_Anything,), {})

        module.__getattr__ = attr
        return module

    def exec_module(self, module) -> None:
        pass


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def _record(action: argparse.Action, source: str) -> dict:
    arity = action.nargs
    if isinstance(action, argparse.BooleanOptionalAction):
        kind = "bool"
    elif action.nargs == 0:
        kind = "switch"  # store_true / store_false / store_const
    else:
        kind = "value"
    entry = {
        "options": [o for o in action.option_strings if o.startswith("--")],
        "dest": action.dest,
        "default": _jsonable(action.default),
        "kind": kind,
        "source": source,
    }
    if kind == "switch":
        entry["const"] = _jsonable(action.const)
    if arity not in (None, 0):
        entry["nargs"] = arity
    type_name = getattr(action.type, "__name__", None)
    if type_name in ("int", "float", "loads"):
        entry["type"] = {"loads": "json"}.get(type_name, type_name)
    if action.choices is not None:
        entry["choices"] = [_jsonable(c) for c in action.choices]
    if isinstance(action, argparse._AppendAction):
        entry["append"] = True
    return entry


def _megatron(checkout: Path, parser: argparse.ArgumentParser) -> None:
    typing.override = getattr(typing, "override", lambda f: f)  # Python 3.12's, used by Megatron-LM's models
    sys.path.insert(0, str(checkout))
    from megatron.training.arguments import add_megatron_arguments

    add_megatron_arguments(parser)


def _slime(checkout: Path, parser: argparse.ArgumentParser) -> None:
    sys.meta_path.insert(0, _StandIns({"slime"}))
    spec = importlib.util.spec_from_file_location("slime_arguments", checkout / "slime" / "utils" / "arguments.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.get_slime_extra_args_provider()(parser)
    pre = argparse.ArgumentParser(add_help=False)  # _pre_parse_mode's flags, parsed apart from the rest
    source = (checkout / "slime" / "utils" / "arguments.py").read_text()
    body = source[source.index("def _pre_parse_mode") : source.index("def parse_args")]
    for line in body.splitlines():
        if "temp_parser.add_argument(" in line:
            eval(line.strip().replace("temp_parser.", "pre."), {"pre": pre})
    for action in pre._actions:
        parser._add_action(action)


def _sglang(parser: argparse.ArgumentParser, slime_checkout: Path) -> None:
    """slime's ``add_sglang_arguments``, run with the installed router's and SGLang's classes."""
    sys.meta_path.append(
        _StandIns(
            {
                "IPython",
                "zmq",
                "uvloop",
                "setproctitle",
                "pybase64",
                "orjson",
                "sgl_kernel",
                "flashinfer",
                "xgrammar",
                "outlines",
                "partial_json_parser",
                "openai_harmony",
                "compressed_tensors",
                "decord",
                "soundfile",
                "av",
            }
        )
    )
    text = (slime_checkout / "slime" / "backends" / "sglang_utils" / "arguments.py").read_text()
    namespace: dict = {}
    sys.modules.setdefault("slime.utils.http_utils", types.SimpleNamespace(_wrap_ipv6=lambda host: host))
    exec(compile(text[: text.index("def validate_args")], "sglang_utils/arguments.py", "exec"), namespace)
    namespace["add_sglang_arguments"](parser)


def _work_tree(path: Path, probe: str) -> Path:
    """A checkout's files: ``path`` itself, or, for a bare git directory (``fetch``'s mirrors), its HEAD."""
    if (path / probe).exists():
        return path
    tree = Path(tempfile.mkdtemp(prefix=path.name))
    archive = subprocess.run(["git", "-C", str(path), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("slime", type=Path)
    cli.add_argument("megatron", type=Path)
    cli.add_argument("--triton-site", default=None)
    options = cli.parse_args()
    if options.triton_site:
        sys.path.append(options.triton_site)
    commit = {
        name: subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
        for name, path in (("slime", options.slime), ("megatron", options.megatron))
    }
    options.slime = _work_tree(options.slime, "slime/utils/arguments.py")
    options.megatron = _work_tree(options.megatron, "megatron/training/arguments.py")
    # Megatron's and slime's flags share one parser, as in slime (its resets change Megatron's
    # defaults); the SGLang and router flags have a parser of their own there too.
    train = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _megatron(options.megatron, train)
    megatron = set(map(id, train._actions))
    _slime(options.slime, train)
    servers = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _sglang(servers, options.slime)
    flags: list[dict] = []
    for parser, source in ((train, None), (servers, "sglang")):
        for action in parser._actions:
            if action.option_strings:
                flags.append(_record(action, source or ("megatron" if id(action) in megatron else "slime")))
    import importlib.metadata as metadata

    versions = {"sglang": metadata.version("sglang"), "sglang-router": metadata.version("sglang-router")}
    OUT.write_text(json.dumps({"read_from": commit | versions, "flags": flags}, indent=0) + "\n")
    print(f"{len(flags)} flags -> {OUT}")


if __name__ == "__main__":
    main()
