"""``inverted train``'s entry point.

``run`` checks everything first (config, plug-ins, datasets, the output directory), then starts the job and
runs the loop under its supervisor. The loop resumes where a checkpoint left off (the servers get its
weights; a LoRA run's servers get its adapter before the first rollout, as the policy to name in every
call). At the end: ``reward.png``, and the command that browses the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Callable

import yaml

from inverted.buffer.filters import load_group_chooser, load_group_filter
from inverted.config import plugin_flags, to_flags
from inverted.controller.config import JobConfig
from inverted.controller.job import Job
from inverted.controller.loop import train
from inverted.controller.rollouts import job_flags, read_prompts
from inverted.controller.trainer import checkpoint_dir
from inverted.errors import ConfigError
from inverted.metrics import build_metrics_sink, plot_rewards
from inverted.plugins import LossPlugins, Plugins
from inverted.processes import freeze_startup_heap

logger = logging.getLogger(__name__)


def run(cfg: JobConfig, router_args: list[str], sglang_args: list[str], process_setup: Callable[[str], None]) -> None:
    """``inverted train``: check everything, then run the loop with every part started.
    ``process_setup(role)``: what each process the job starts on Ray runs first (the entry point's
    logging and plug-in adapters)."""
    cfg.validate()
    checkpoint = Path(cfg.train.hf_checkpoint)
    if not (checkpoint / "config.json").is_file():  # never taken for a hub id: nothing is downloaded
        raise ConfigError(f"--hf-checkpoint {checkpoint}: not a Hugging Face checkpoint directory (no config.json)")
    plugins = Plugins.load(cfg.rollout, job_flags(cfg))
    LossPlugins.load(
        cfg.train.loss, plugin_flags(cfg.train)
    )  # the trainer's and the buffer's load in their own processes:
    load_group_filter(cfg.buffer), load_group_chooser(cfg.buffer)  # check them here, before any starts
    for data in (cfg.buffer.prompt_data, cfg.rollout.eval_prompt_data if cfg.rollout.eval_interval else None):
        if data:  # a dataset the buffer would refuse fails here, before any process starts
            read_prompts(cfg.buffer, data)
    run_dir = Path(cfg.train.output_dir)
    if (run_dir / "buffer.db").exists() and not cfg.train.ckpt.load:
        raise ConfigError(
            f"--output-dir {run_dir} holds an earlier run: resume it with --load "
            f"{checkpoint_dir(cfg.train)}, or choose another --output-dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    # The resolved flags, by section: each section's keys are a --config file of its command.
    resolved = {f.name: to_flags(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    asyncio.run(run_job(cfg, plugins, router_args, sglang_args, process_setup))


async def run_job(
    cfg: JobConfig,
    plugins: Plugins,
    router_args: list[str],
    sglang_args: list[str],
    process_setup: Callable[[str], None],
) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    sink = build_metrics_sink(cfg.train.output_dir)
    run_dir = Path(cfg.train.output_dir)
    try:
        # Log lines go above the progress bar instead of through it.
        with logging_redirect_tqdm():
            async with Job(cfg, router_args, sglang_args, process_setup) as job:
                freeze_startup_heap()
                await job.supervisor.run(train(cfg, job, plugins, sink, run_dir))
    finally:
        sink.close()
        if (run_dir / "metrics.jsonl").exists() and plot_rewards(stages(cfg), run_dir / "reward.png"):
            logger.info("reward curve: %s", run_dir / "reward.png")
        if (run_dir / "buffer.db").exists():  # on stdout, whatever --log-level: the run's last word
            print(f"browse this run's curves, Samples and trajectories: inverted view {run_dir}", flush=True)


def stages(cfg: JobConfig) -> list[Path]:
    """The metrics of this run, after those of the run whose episodes it learns from (``--bootstrap-from``)."""
    own = Path(cfg.train.output_dir) / "metrics.jsonl"
    source = Path(cfg.rollout.bootstrap_from) if cfg.rollout.bootstrap_from else None
    source = source.parent if source is not None and source.suffix == ".db" else source
    return [source / "metrics.jsonl", own] if source is not None and (source / "metrics.jsonl").exists() else [own]
