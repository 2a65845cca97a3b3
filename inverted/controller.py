"""The main job, ``inverted train``: start every part, run the sync loop, always clean up.

The recipe, one rollout at a time (``run_rollouts`` and ``rollout_step``):

1. **lease** ``--rollout-batch-size`` prompts x ``--n-samples-per-prompt`` tasks from the buffer;
2. **rollout**: the rollout function turns them into Samples (by default, environment episodes
   through the token-recording proxy), and they are submitted to the buffer, which stores them;
3. **batch**: the buffer serves the complete groups (failed or filtered groups are never served);
4. **train** on them (the Megatron trainer, a Ray actor group), then **sync** the new weights into
   every rollout server, stamped with the next weight version;
5. **log** one metrics row (``metrics.jsonl``, TensorBoard, a console line), checkpoint every
   ``--save-interval``, evaluate every ``--eval-interval``.

Around it, ``run`` starts the parts (``Job``): Ray (local, or ``--ray-address``), the buffer
service on ``OUTPUT_DIR/buffer.db``, the rollout servers behind the real sgl-router (each started
by a Ray actor), the proxy, and the trainer; each service on a free loopback port with an
unguessable key. A child that dies stops the job with its name, exit code and log tail. At the
end: a final checkpoint, a Hugging Face export (``OUTPUT_DIR/hf``) and ``reward.png``.
``--debug-rollout-only`` runs the same loop without a trainer and saves what it would train on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import secrets
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, Callable

import yaml

from inverted.buffer.client import BufferClient
from inverted.buffer.datasets import load_prompts
from inverted.config import JobConfig, flag_name
from inverted.errors import ConfigError, PluginError, ServiceUnavailable
from inverted.metrics import MetricsSink, build_metrics_sink, plot_rewards
from inverted.placement import ray_launch, start_ray
from inverted.plugins import RolloutContext, RolloutFunction, load_plugin, load_rollout_function, required_flags
from inverted.rollout.servers import ManagedProcess, RolloutServers, free_port
from inverted.rollout.sglang_client import SGLangClient
from inverted.types import Sample, Task

logger = logging.getLogger(__name__)

WORKER_ID = "controller"


@dataclasses.dataclass(slots=True)
class Plugins:
    """The user code the job runs, loaded (and checked) before any process starts."""

    rollout: RolloutFunction
    env: Callable | None
    reward: Callable | None

    @classmethod
    def load(cls, job: JobConfig) -> "Plugins":
        cfg = job.rollout
        env = load_plugin(cfg.env_path, flag="--env-path", params=["task", "client"]) if cfg.env_path else None
        if env is not None and not inspect.iscoroutinefunction(env):
            raise PluginError(f"--env-path={cfg.env_path!r}: expected 'async def {env.__name__}(task, client) -> reward'")
        reward = load_plugin(cfg.custom_rm_path, flag="--custom-rm-path", params=["sample"]) if cfg.custom_rm_path else None
        rollout = load_rollout_function(cfg.rollout_function_path)
        for name in required_flags(rollout):
            if not getattr(cfg, name):
                raise ConfigError(f"--rollout-function-path {cfg.rollout_function_path} needs {flag_name(name)}")
        return cls(rollout, env, reward)


def start_service(command: str, section: Any, run_dir: Path, url: str, timeout: float) -> ManagedProcess:
    """``inverted COMMAND --config run_dir/services/COMMAND.yaml`` (owner-only: it holds the key)."""
    config = run_dir / "services" / f"{command}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.touch(mode=0o600)
    config.write_text(yaml.safe_dump(dataclasses.asdict(section), sort_keys=False))
    argv = [sys.executable, "-m", "inverted.cli", command, "--config", str(config)]
    process = ManagedProcess.spawn(command, argv, run_dir / "logs" / f"{command}.log", url)
    process.wait_healthy(timeout)
    return process


class Job:
    """Every running part of one ``inverted train``; ``async with Job(...)`` starts and stops them."""

    def __init__(self, job: JobConfig, router_args: list[str], sglang_args: list[str], log_setup: Callable[[str], None]):
        self.cfg, self.router_args, self.sglang_args, self.log_setup = job, router_args, sglang_args, log_setup
        self.run_dir = Path(job.train.output_dir)
        self.processes: list[ManagedProcess] = []
        self.trainer = None
        self.version = 0  # the weight version the servers hold (the trainer's rollout id at its last sync)
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> "Job":
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        cfg, timeout = self.cfg, self.cfg.servers.startup_timeout
        start_ray(cfg.rollout.ray_address)
        port, key = free_port(), secrets.token_urlsafe(24)
        buffer_cfg = dataclasses.replace(cfg.buffer, db=str(self.run_dir / "buffer.db"), port=port, api_key=key)
        self.processes.append(await asyncio.to_thread(start_service, "buffer", buffer_cfg, self.run_dir,
                                                      f"http://127.0.0.1:{port}", timeout))
        self.buffer = await self._stack.enter_async_context(BufferClient(self.processes[-1].url, api_key=key))

        servers_cfg = dataclasses.replace(cfg.servers, log_dir=str(self.run_dir / "logs"))
        gpus = cfg.servers.rollout_num_gpus_per_engine * (0.5 if cfg.rollout.colocate else 1.0)
        self.servers = RolloutServers(servers_cfg, self.router_args, self.sglang_args,
                                      launch=ray_launch(gpus if _has_cuda() else 0, cfg.rollout.ray_address is None))
        trainer = None if cfg.rollout.debug_rollout_only else asyncio.to_thread(self._start_trainer)
        await asyncio.gather(self.servers.start(), *([trainer] if trainer else []))

        port, self.proxy_key = free_port(), secrets.token_urlsafe(24)
        proxy_cfg = dataclasses.replace(cfg.proxy, router_url=self.servers.router_url, tokenizer=cfg.train.hf_checkpoint,
                                        proxy_port=port, proxy_api_key=self.proxy_key)
        self.processes.append(await asyncio.to_thread(start_service, "proxy", proxy_cfg, self.run_dir,
                                                      f"http://127.0.0.1:{port}", timeout))
        self.proxy_url = self.processes[-1].url

    def _start_trainer(self) -> None:
        from inverted.train.actor import TrainGroup

        self.trainer = TrainGroup(self.cfg.train, self.log_setup, gpu_fraction=0.5 if self.cfg.rollout.colocate else 1.0)

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()
        self.servers.check_alive()

    async def __aexit__(self, *exc: object) -> None:
        import ray

        await self._stack.aclose()
        if self.trainer is not None:
            await asyncio.to_thread(self.trainer.shutdown)
        if hasattr(self, "servers"):
            self.servers.stop()
        for process in reversed(self.processes):
            process.terminate()
        if self.cfg.rollout.ray_address is None:
            ray.shutdown()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run(job: JobConfig, router_args: list[str], sglang_args: list[str], log_setup: Callable[[str], None]) -> None:
    """``inverted train``: check everything, then run the loop with every part started."""
    job.validate()
    plugins = Plugins.load(job)
    for data in (job.buffer.prompt_data, job.rollout.eval_prompt_data if job.rollout.eval_interval else None):
        if data:  # a dataset the buffer would refuse fails here, before any process starts
            read_prompts(job, data)
    run_dir = Path(job.train.output_dir)
    if (run_dir / "buffer.db").exists() and not job.train.load:
        raise ConfigError(f"--output-dir {run_dir} holds an earlier run: resume it with --load "
                          f"{checkpoint_dir(job)}, or choose another --output-dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(job), sort_keys=False))
    asyncio.run(run_loop(job, plugins, router_args, sglang_args, log_setup))


async def run_loop(cfg: JobConfig, plugins: Plugins, router_args: list[str], sglang_args: list[str],
                   log_setup: Callable[[str], None]) -> None:
    from tqdm.contrib.logging import logging_redirect_tqdm

    sink = build_metrics_sink(cfg.train.output_dir)
    run_dir = Path(cfg.train.output_dir)
    try:
        # Log lines go above the progress bar instead of through it.
        with logging_redirect_tqdm():
            await run_rollouts(cfg, plugins, router_args, sglang_args, log_setup, sink, run_dir)
    finally:
        sink.close()
        if (run_dir / "metrics.jsonl").exists() and plot_rewards(run_dir / "metrics.jsonl", run_dir / "reward.png"):
            logger.info("reward curve: %s", run_dir / "reward.png")


async def run_rollouts(cfg: JobConfig, plugins: Plugins, router_args: list[str], sglang_args: list[str],
                       log_setup: Callable[[str], None], sink: MetricsSink, run_dir: Path) -> None:
    """Start the job's parts, then rollout after rollout until ``--num-rollout``; a final export."""
    from tqdm import tqdm

    async with Job(cfg, router_args, sglang_args, log_setup) as job:
        start = job.trainer.rollout_id if job.trainer else 0
        if start:  # resumed: the servers still hold the starting weights
            await asyncio.to_thread(job.trainer.sync_weights, job.servers.engine_urls, start)
            job.version = start
        for rollout_id in tqdm(range(start, cfg.train.num_rollout), desc="rollout", initial=start,
                               total=cfg.train.num_rollout, dynamic_ncols=True):
            job.check_alive()
            metrics = await rollout_step(cfg, job, plugins, rollout_id)
            if cfg.rollout.eval_interval and (rollout_id + 1) % cfg.rollout.eval_interval == 0:
                metrics |= await evaluate(cfg, job, plugins, rollout_id)
            sink.log(metrics, rollout_id)
            logger.info("rollout %d: %s", rollout_id, summary(metrics))
            last = rollout_id + 1 == cfg.train.num_rollout
            if job.trainer and (last or (cfg.train.save_interval and (rollout_id + 1) % cfg.train.save_interval == 0)):
                await asyncio.to_thread(job.trainer.save, checkpoint_dir(cfg))
        if job.trainer and start < cfg.train.num_rollout:
            out = await asyncio.to_thread(job.trainer.export_hf, checkpoint_dir(cfg), str(run_dir / "hf"))
            logger.info("final policy exported to %s", out)


def read_prompts(cfg: JobConfig, path: str):
    return load_prompts(path, input_key=cfg.buffer.input_key, label_key=cfg.buffer.label_key,
                        metadata_key=cfg.buffer.metadata_key, tool_key=cfg.buffer.tool_key)


def checkpoint_dir(cfg: JobConfig) -> str:
    return cfg.train.save or str(Path(cfg.train.output_dir) / "checkpoints")


def context(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int, evaluation: bool = False) -> RolloutContext:
    import argparse

    sampling = {"temperature": cfg.train.rollout_temperature, "top_p": cfg.rollout.rollout_top_p,
                "max_tokens": cfg.rollout.rollout_max_response_len}
    router = job.servers.router_url.rsplit(":", 1)
    slime_args = argparse.Namespace(**{k: v for part in (cfg.train, cfg.rollout, cfg.buffer, cfg.servers)
                                       for k, v in dataclasses.asdict(part).items()},
                                    sglang_router_ip=router[0].split("//")[-1], sglang_router_port=int(router[1]))
    return RolloutContext(rollout_id=rollout_id, config=cfg.rollout, proxy_url=job.proxy_url, proxy_api_key=job.proxy_key,
                          router_url=job.servers.router_url, hf_checkpoint=cfg.train.hf_checkpoint, sampling=sampling,
                          env=plugins.env, reward_fn=plugins.reward, evaluation=evaluation, slime_args=slime_args)


async def run_rollout(cfg: JobConfig, ctx: RolloutContext, plugins: Plugins, tasks: list[Task]) -> list[Sample]:
    """The rollout function's Samples, one per task, checked (the function is user code)."""
    samples = await plugins.rollout(ctx, tasks)
    path = cfg.rollout.rollout_function_path
    if not isinstance(samples, list) or not all(isinstance(s, Sample) for s in samples):
        raise PluginError(f"--rollout-function-path {path}: expected a list of Samples, got {type(samples).__name__}")
    by_key = {(s.group_index, s.index): s for s in samples}
    missing = [(t.group_index, t.index) for t in tasks if (t.group_index, t.index) not in by_key]
    if missing or len(samples) != len(tasks):
        raise PluginError(f"--rollout-function-path {path}: expected one Sample per task ({len(tasks)}), got "
                          f"{len(samples)}; tasks without one (group_index, index): {missing[:5]}")
    return [by_key[(t.group_index, t.index)] for t in tasks]


async def rollout_step(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int) -> dict[str, float]:
    """One turn of the sync loop; its metrics row."""
    clock = {"started": time.perf_counter()}
    tasks = await job.buffer.lease(cfg.rollout.rollout_batch_size * cfg.buffer.n_samples_per_prompt, WORKER_ID,
                                   cfg.buffer.lease_seconds)
    if not tasks:
        raise ServiceUnavailable("the buffer has no more tasks to lease (the dataset is exhausted: see --num-epoch)",
                                 url=job.buffer.base_url)
    clock["leased"] = time.perf_counter()
    samples = await run_rollout(cfg, context(cfg, job, plugins, rollout_id), plugins, tasks)
    clock["rolled_out"] = time.perf_counter()
    await job.buffer.submit(list(zip(tasks, samples)))
    batch = await job.buffer.next_batch(num_groups=cfg.rollout.rollout_batch_size, current_weight_version=job.version,
                                        allow_partial=True)
    clock["batched"] = time.perf_counter()
    save_rollout_data(cfg, rollout_id, batch.samples)
    metrics = rollout_metrics(cfg, samples, batch.samples)
    failed = [s for s in samples if s.status == Sample.Status.FAILED]
    if failed:
        logger.warning("rollout %d: %d of %d episodes failed (never trained on); the first: %s", rollout_id,
                       len(failed), len(samples), failed[0].metadata.get("error", "?"))
    if job.trainer is not None and batch.samples:
        if cfg.rollout.colocate:
            await all_servers(job, "release_memory_occupation")
        metrics |= await asyncio.to_thread(job.trainer.train, batch.samples)
        if cfg.rollout.colocate:
            await all_servers(job, "resume_memory_occupation")
        clock["trained"] = time.perf_counter()
        report = await asyncio.to_thread(job.trainer.sync_weights, job.servers.engine_urls, rollout_id + 1)
        metrics |= {f"sync/{k}": float(v) for k, v in (report or {}).items() if isinstance(v, (int, float))}
        job.version = rollout_id + 1
        clock["synced"] = time.perf_counter()
    elif job.trainer is not None:  # every group failed or was filtered: nothing to learn, the weights stay
        logger.info("rollout %d: no group to train on; the policy stays at version %d", rollout_id, job.version)
        await asyncio.to_thread(job.trainer.skip, rollout_id)
    return metrics | phase_times(clock) | {"weight_version": float(job.version)}


async def all_servers(job: Job, method: str) -> None:
    async def call(url: str) -> None:
        async with SGLangClient(url) as client:
            await getattr(client, method)()
    await asyncio.gather(*(call(url) for url in job.servers.engine_urls))


def phase_times(clock: dict[str, float]) -> dict[str, float]:
    """Seconds per phase of one step (a phase that did not happen is absent)."""
    marks = list(clock.items())
    names = {"leased": "lease", "rolled_out": "rollout", "batched": "buffer", "trained": "train", "synced": "sync"}
    times = {f"time/{names[name]}_s": at - before for (_, before), (name, at) in zip(marks, marks[1:])}
    times["time/step_s"] = marks[-1][1] - marks[0][1]
    return times


def rollout_metrics(cfg: JobConfig, samples: list[Sample], trained: list[Sample]) -> dict[str, float]:
    usable = [s for s in samples if s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)]
    rewards = [s.scalar_reward(cfg.train.reward_key) for s in usable]
    lengths = [s.response_length for s in usable]
    return {
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollout/samples": float(len(samples)), "rollout/trained_samples": float(len(trained)),
        "rollout/failed": float(sum(s.status == Sample.Status.FAILED for s in samples)),
        "rollout/truncated": float(sum(s.status == Sample.Status.TRUNCATED for s in samples)),
        "rollout/response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "rollout/response_tokens": float(sum(sum(s.loss_mask) for s in usable)),
    }


def save_rollout_data(cfg: JobConfig, rollout_id: int, samples: list[Sample]) -> None:
    """``--save-debug-rollout-data``: what this rollout trains on, one Sample per line (the
    format ``--load-debug-rollout-data`` reads)."""
    import orjson

    if not cfg.rollout.save_debug_rollout_data:
        return
    path = Path(cfg.rollout.save_debug_rollout_data.format(rollout_id=rollout_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if "{rollout_id}" in cfg.rollout.save_debug_rollout_data or rollout_id == 0 else "ab"
    with path.open(mode) as out:
        out.writelines(orjson.dumps(s.to_json()) + b"\n" for s in samples)


async def evaluate(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int) -> dict[str, float]:
    """The rollout function on ``--eval-prompt-data`` (through no buffer: nothing here is trained on)."""
    records = read_prompts(cfg, cfg.rollout.eval_prompt_data)
    n = cfg.rollout.n_samples_per_eval_prompt
    tasks = [Task(lease_id="eval", group_index=i, index=i * n + j, prompt_index=i, prompt=r.prompt, label=r.label,
                  metadata=r.metadata, tools=r.tools) for i, r in enumerate(records) for j in range(n)]
    samples = await run_rollout(cfg, context(cfg, job, plugins, rollout_id, evaluation=True), plugins, tasks)
    rewards = [s.scalar_reward(cfg.train.reward_key) for s in samples if s.status != Sample.Status.FAILED]
    return {"eval/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
            "eval/failed": float(len(samples) - len(rewards))}


def summary(metrics: dict[str, float]) -> str:
    shown = {"reward": "rollout/reward_mean", "loss": "train/loss", "eval": "eval/reward_mean",
             "version": "weight_version", "step_s": "time/step_s", "rollout_s": "time/rollout_s",
             "train_s": "time/train_s", "sync_s": "time/sync_s"}
    return ", ".join(f"{name} {metrics[key]:.4g}" for name, key in shown.items() if key in metrics)
