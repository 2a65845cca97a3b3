"""The main job, ``inverted train``: start every part, run the loop, supervise, always clean up.

- ``job``: the running parts (Ray, buffer, rollout servers behind the router, proxy, trainer),
  their supervision (dead rollout servers are replaced and given the current weights) and the
  one door into the trainer.
- ``sync_loop``: each step rolls out a batch, trains on it, syncs the weights.
- ``async_loop`` (``--async-mode`` or ``inverted train-async``): rollout never stops; each step
  trains on the next batch within ``--max-weight-staleness`` while episodes run on.
- ``rollouts``: what both loops share: calling the rollout function, its metrics, evaluation.

``run`` checks everything first (config, plug-ins, datasets, the output directory), then
``drive`` runs either loop the same way: resume (the servers get the checkpoint's weights; a LoRA
run's servers get its adapter before the first rollout, as the policy to name in every call), one
step per ``--num-rollout``, evaluation before the first step, every ``--eval-interval`` and after
the last (rows of their own, greedy unless ``--eval-temperature``), a metrics row per step
(``metrics.jsonl``, TensorBoard, a console line), a checkpoint every ``--save-interval`` and at the
end, then a Hugging Face export (``OUTPUT_DIR/hf``) and ``reward.png``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Callable

import yaml

from inverted.buffer.filters import load_group_chooser, load_group_filter
from inverted.config import JobConfig, plugin_flags, to_flags
from inverted.controller.async_loop import AsyncLoop
from inverted.controller.job import Job, Plugins, checkpoint_dir, restart_dir
from inverted.controller.rollouts import evaluate, job_flags, read_prompts, summary
from inverted.controller.sync_loop import SyncLoop
from inverted.errors import ConfigError
from inverted.metrics import MetricsSink, build_metrics_sink, plot_rewards
from inverted.plugins import LossPlugins
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
    LossPlugins.load(cfg.train.loss, plugin_flags(cfg.train))  # the trainer's and the buffer's load in their own processes:
    load_group_filter(cfg.buffer), load_group_chooser(cfg.buffer)  # check them here, before any starts
    for data in (cfg.buffer.prompt_data, cfg.rollout.eval_prompt_data if cfg.rollout.eval_interval else None):
        if data:  # a dataset the buffer would refuse fails here, before any process starts
            read_prompts(cfg.buffer, data)
    run_dir = Path(cfg.train.output_dir)
    if (run_dir / "buffer.db").exists() and not cfg.train.ckpt.load:
        raise ConfigError(f"--output-dir {run_dir} holds an earlier run: resume it with --load "
                          f"{checkpoint_dir(cfg.train)}, or choose another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    # The resolved flags, by section: each section's keys are a --config file of its command.
    resolved = {f.name: to_flags(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    asyncio.run(run_job(cfg, plugins, router_args, sglang_args, process_setup))


async def run_job(cfg: JobConfig, plugins: Plugins, router_args: list[str], sglang_args: list[str],
                  process_setup: Callable[[str], None]) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    sink = build_metrics_sink(cfg.train.output_dir)
    run_dir = Path(cfg.train.output_dir)
    try:
        # Log lines go above the progress bar instead of through it.
        with logging_redirect_tqdm():
            async with Job(cfg, router_args, sglang_args, process_setup) as job:
                freeze_startup_heap()
                await job.run_supervised(drive(cfg, job, plugins, sink, run_dir))
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


async def evaluate_and_log(cfg: JobConfig, job: Job, plugins: Plugins, sink: MetricsSink, updates: int) -> None:
    """Evaluate the policy after ``updates`` training steps; its row's step is that count, so step 0
    is the starting policy and an evaluation's step is the rollout its policy would serve next."""
    metrics = await evaluate(cfg, job, plugins, updates)
    sink.log(metrics | {"weight_version": float(job.version)}, updates)
    logger.info("evaluation after %d updates: %s", updates, summary(metrics))


async def drive(cfg: JobConfig, job: Job, plugins: Plugins, sink: MetricsSink, run_dir: Path) -> None:
    """Step after step until ``--num-rollout``, with evaluation, metrics and checkpoints; a final export."""
    from tqdm import tqdm

    start = job.trainer.rollout_id if job.trainer else 0
    if start or (job.lora and job.trainer):  # resumed: the servers hold the starting weights; LoRA: no adapter yet
        await job.sync_weights(start)
    loop = AsyncLoop(cfg, job, plugins, start) if cfg.loop.async_mode else SyncLoop(cfg, job, plugins, start)
    evaluating = bool(cfg.rollout.eval_interval)
    if evaluating and start == 0:  # the starting policy, so that every later figure has its baseline
        await evaluate_and_log(cfg, job, plugins, sink, 0)
    async with loop:
        for rollout_id in tqdm(range(start, cfg.train.num_rollout), desc="rollout", initial=start,
                               total=cfg.train.num_rollout, dynamic_ncols=True):
            metrics = await loop.step(rollout_id)
            sink.log(metrics, rollout_id)
            logger.info("rollout %d: %s", rollout_id, summary(metrics))
            last = rollout_id + 1 == cfg.train.num_rollout
            if evaluating and (last or (rollout_id + 1) % cfg.rollout.eval_interval == 0):
                await evaluate_and_log(cfg, job, plugins, sink, rollout_id + 1)
            every, restart = cfg.train.ckpt.save_interval, cfg.train.ckpt.restart_save_interval
            if job.trainer and (last or (every and (rollout_id + 1) % every == 0)):
                await job.trainer_call("save", checkpoint_dir(cfg.train))
            elif job.trainer and restart and (rollout_id + 1) % restart == 0:  # written during the next rollout
                await job.trainer_call("save_for_restart", restart_dir(cfg.train))
    if job.trainer and start < cfg.train.num_rollout:
        out = await job.trainer_call("finish", checkpoint_dir(cfg.train), str(run_dir / "hf"))
        logger.info("final policy exported to %s", out)
        shutil.rmtree(restart_dir(cfg.train), ignore_errors=True)  # the final checkpoint holds more
