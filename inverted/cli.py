"""``inverted <command>``: the command line. Builds a config section from flags and calls one entry point.

Commands: ``make-tiny-model`` (a local random checkpoint), ``import-gguf`` (a real model shipped as
GGUF, as a checkpoint), ``serve-engine`` (the embedded SGLang-protocol engine), ``buffer`` (the Data
Buffer service), ``proxy`` (the token-recording OpenAI proxy), ``servers`` (N engines behind the real
sgl-router, with a short demo generation through it), ``train`` (the main job: the RL loop over all of
them, or ``--debug-train-only`` from saved rollout data; ``train-async`` is ``train --async-mode``),
``tinker-serve`` (the Tinker training API: the user's script drives the loop), ``export-hf`` and
``view`` (a job's run directory in the browser). Logging is configured here and only here, with the
process role in every line. Heavy imports happen inside each command so ``inverted --help`` is instant.

It is also where other frameworks' plug-ins become loadable: before a command runs, and first thing
in the trainer's workers (``setup_process``), ``compat.register()`` fills the plug-in loader's
registry with their forms (slime's), and slime's ``train.py`` flags given to ``train`` are parsed
and acted on here (``compat.slime_flags``, ``compat.slime_config``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path
from typing import Callable

from inverted import compat
from inverted.buffer.config import BufferConfig
from inverted.compat import slime_flags
from inverted.config import (
    ImportGGUFConfig,
    TinyModelConfig,
    add_flags,
    build_section,
    load_yaml_defaults,
    resolve_paths,
    split_passthrough,
)
from inverted.controller.config import JobConfig
from inverted.engine.config import EngineConfig
from inverted.errors import InvertedError
from inverted.rollout.config import ServersConfig
from inverted.rollout.proxy.config import ProxyConfig
from inverted.tinker.config import TinkerServeConfig
from inverted.train.config import ExportConfig
from inverted.view.config import ViewConfig


def setup_logging(role: str, level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )
    for name in ("httpx", "httpx2"):  # they log every request at INFO (httpx2: the openai SDK's copy)
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # it lists every parameter of every bucket at INFO


def setup_process(role: str, level: str = "info") -> None:
    """A process the job starts beyond the command line's own (the trainer's Ray workers), set up as
    this one is: its logging, and the plug-in adapters."""
    setup_logging(role, level)
    compat.register()


def spin_briefly() -> None:
    """Let OpenMP workers spin ~0.1 ms between parallel regions, then sleep. Must precede torch's import.

    A decode or training step is hundreds of short regions: workers put to sleep after each one
    (``OMP_WAIT_POLICY=PASSIVE``) made a 32-row decode step 1.5x slower on 2 cores, while libgomp's
    default ~3 ms of spinning after every region starves the engine's own event loop and the other
    processes on a small machine. A user's own setting wins.
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def cmd_make_tiny_model(cfg: TinyModelConfig) -> None:
    from inverted.tiny_model import make_tiny_model

    print(make_tiny_model(cfg))


def cmd_import_gguf(cfg: ImportGGUFConfig) -> None:
    from inverted.gguf_import import import_gguf

    print(import_gguf(cfg))


def cmd_serve_engine(cfg: EngineConfig) -> None:
    spin_briefly()
    import uvicorn

    from inverted.engine.server import create_app
    from inverted.processes import UVICORN_OPTIONS

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, **UVICORN_OPTIONS)


def cmd_buffer(cfg: BufferConfig) -> None:
    from inverted.buffer.service import serve

    serve(cfg, compat.register)  # its worker processes load the filters too


def cmd_proxy(cfg: ProxyConfig) -> None:
    from inverted.rollout.proxy.service import serve

    serve(cfg)


def cmd_servers(cfg: ServersConfig, router_args: list[str], sglang_args: list[str]) -> None:
    import asyncio

    from inverted.rollout.servers import run_demo

    asyncio.run(run_demo(cfg, router_args, sglang_args))


def ray_token_auth() -> None:
    """One rule for Ray's token authentication, here, in the docs and in every recipe: it is on
    wherever a token is available (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``),
    and ``RAY_AUTH_MODE=disabled`` turns it off. Ray enables it itself for a new local cluster and for
    ``ray start --head`` beside a token file, but not when joining one by address, which then fails
    against a head with a token. Set before Ray loads (it reads the mode once); its children inherit it."""
    available = (
        bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
        or (Path.home() / ".ray" / "auth_token").is_file()
    )
    if available and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def cmd_train(
    cfg: JobConfig, router_args: list[str], sglang_args: list[str], slime: slime_flags.SlimeFlags | None = None
) -> None:
    from inverted.compat.slime_config import apply

    if cfg.train.debug_train_only:  # no servers: straight from saved rollout data
        from inverted.train.offline import run_offline

        apply(cfg, slime, sglang_args, "embedded")
        run_offline(cfg.train, compat.register)
        return
    spin_briefly()  # inherited by the engines and the trainer
    ray_token_auth()
    from inverted.controller.main import run
    from inverted.rollout.servers import resolve_backend

    sglang_args = apply(cfg, slime, sglang_args, resolve_backend(cfg.servers))
    run(cfg, router_args, sglang_args, functools.partial(setup_process, level=cfg.train.log_level))


def cmd_tinker_serve(cfg: TinkerServeConfig, router_args: list[str], sglang_args: list[str]) -> None:
    spin_briefly()  # inherited by the engines; the trainer runs in this process
    from inverted.tinker.service import serve

    serve(cfg, router_args, sglang_args)


def cmd_export_hf(cfg: ExportConfig) -> None:
    from inverted.train.export import export_hf

    print(export_hf(cfg.checkpoint, cfg.out, cfg.merge_lora))


def cmd_view(cfg: ViewConfig) -> None:
    from inverted.view.service import serve

    serve(cfg)


# name: (its config section, what runs it, its help); a command that launches servers takes their arguments
COMMANDS: dict[str, tuple[type, Callable[..., None], str]] = {
    "make-tiny-model": (TinyModelConfig, cmd_make_tiny_model, "write a random-initialized HF checkpoint and tokenizer"),
    "import-gguf": (
        ImportGGUFConfig,
        cmd_import_gguf,
        "convert a GGUF model (a file, or one a package ships) to a HF checkpoint",
    ),
    "serve-engine": (EngineConfig, cmd_serve_engine, "run the embedded SGLang-protocol engine"),
    "buffer": (BufferConfig, cmd_buffer, "run the Data Buffer service (durable tasks and trajectories)"),
    "proxy": (ProxyConfig, cmd_proxy, "run the token-recording OpenAI-compatible proxy in front of the router"),
    "servers": (
        ServersConfig,
        cmd_servers,
        "start embedded engines behind the real sgl-router and generate through it",
    ),
    "train": (JobConfig, cmd_train, "the main job: rollout servers, proxy, buffer and trainer in the RL loop"),
    "tinker-serve": (
        TinkerServeConfig,
        cmd_tinker_serve,
        "the Tinker training API (the official SDK's base_url) on the trainer and the rollout servers",
    ),
    "export-hf": (ExportConfig, cmd_export_hf, "write a training checkpoint as a Hugging Face model"),
    "view": (ViewConfig, cmd_view, "browse a run: its curves, its Samples, each trajectory token by token"),
}


PASSTHROUGH = {"servers", "train", "tinker-serve"}  # commands that launch servers: --router-* and --sglang-* go to them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inverted", description="RL post-training where the environment drives the loop."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (section, _, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        cmd.add_argument("--config", default=None, help="YAML file with the same keys as the flags (flags override it)")
        add_flags(cmd, section)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """One command's parser (argparse keeps them in its sub-parsers action)."""
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train-async"]:  # slime's name for its async driver: the same job in --async-mode
        argv = ["train", "--async-mode", *argv[1:]]
    router_args: list[str] = []
    sglang_args: list[str] = []
    launches_servers = bool(argv) and argv[0] in PASSTHROUGH
    if launches_servers:
        argv, router_args = split_passthrough(argv, "router", {"--router-host", "--router-port"})
        argv, sglang_args = split_passthrough(argv, "sglang")
    parser = build_parser()
    try:
        if launches_servers:
            argv = slime_flags.slime_forms(argv)
        args, rest = parser.parse_known_args(argv)
        if args.config:
            load_yaml_defaults(command_parser(parser, args.command), args.config)
            args, rest = parser.parse_known_args(argv)
        if rest and args.command != "train":
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        # slime's train.py flags beyond inverted's: each implemented, accepted without effect, or refused with why
        extra = [slime_flags.parse(rest, set(vars(args)))] if args.command == "train" else []
        section, run, _ = COMMANDS[args.command]
        cfg = build_section(section, args)
        resolve_paths(cfg)  # against this working directory, before any process starts elsewhere
        setup_logging(args.command, vars(args).get("log_level", "info"))  # commands without --log-level: info
        compat.register()  # before any plug-in loads, in this process and the services it runs as
        if launches_servers:
            run(cfg, router_args, sglang_args, *extra)
        else:
            run(cfg)
    except InvertedError as exc:
        parser.exit(2, f"inverted {argv[0] if argv else ''}: error: {exc}\n")
    except KeyboardInterrupt:
        parser.exit(130)


if __name__ == "__main__":
    main()
