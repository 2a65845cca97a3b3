"""``inverted train --debug-train-only``: learn from saved rollout data, with no rollout servers.

The data is jsonl, one Sample per line in its JSON form (``types.py``): exactly what
``--save-debug-rollout-data`` writes on the rollout side; or another framework's dump, by the
suffix an adapter registered (``plugins.DUMP_FORMATS``: ``.pt``, slime's). A ``{rollout_id}`` in the path picks
one file per rollout; without it every rollout trains on the same file. Rank 0 writes one JSON
object per rollout to ``OUT/metrics.jsonl`` (and TensorBoard), and checkpoints follow
``--save`` / ``--save-interval``; ``--load`` resumes where a run stopped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
import yaml

from inverted.config import to_flags
from inverted.errors import ConfigError, SampleError
from inverted.hf_checkpoint import ModelSpec
from inverted.plugins import DUMP_FORMATS
from inverted.train.config import TrainConfig
from inverted.train.trainer import check_samples, sample_name
from inverted.types import Sample, unfold_siblings

logger = logging.getLogger(__name__)


def read_rollout_data(template: str | None, rollout_id: int) -> list[Sample]:
    if template is None:
        raise ConfigError("--debug-train-only trains on --load-debug-rollout-data, which is not set")
    path = Path(template.format(rollout_id=rollout_id))
    if path.suffix in DUMP_FORMATS:
        return DUMP_FORMATS[path.suffix].read(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise SampleError(f"--load-debug-rollout-data {path}: cannot read: {exc}") from None
    samples = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                # Python's json reads NaN and Infinity, so such a reward is reported as a bad reward
                # (by Sample.validate) rather than as unreadable JSON.
                samples.append(Sample.from_json(json.loads(line)))
            except SampleError as exc:
                raise SampleError(f"{path}:{number}: {exc}") from None
            except ValueError as exc:
                raise SampleError(f"{path}:{number}: malformed JSON: {exc}") from None
    samples = unfold_siblings(samples)  # a fan-out as the buffer stores it (an older dump's form)
    for position, sample in enumerate(samples):  # where these Samples enter (the job's enter at the buffer)
        try:
            sample.validate()
        except SampleError as exc:
            raise SampleError(f"{sample_name(position, sample)}: {exc}") from None
    return samples


def run_offline(cfg: TrainConfig, setup: Callable[[], None]) -> None:
    """Train ``--num-rollout`` rollouts from files, in ``--actor-num-gpus-per-node`` local processes,
    each first running ``setup`` (the entry point's: the adapters it registers)."""
    from inverted.train.parallel import spawn

    cfg.validate()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_flags(cfg), sort_keys=False))  # a --config file
    # Unreadable or untrainable data fails here, before any process starts and any model is built.
    check_samples(read_rollout_data(cfg.load_debug_rollout_data, 0), ModelSpec.from_checkpoint(cfg.hf_checkpoint))
    spawn(train_worker, cfg.parallel.world_size, cfg, setup)


def train_worker(cfg: TrainConfig, setup: Callable[[], None]) -> None:
    from tqdm import tqdm

    from inverted.metrics import build_metrics_sink
    from inverted.train.checkpoint import resume, save_checkpoint
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    setup()
    init_parallel(cfg.parallel, cfg.seed)
    rank = torch.distributed.get_rank()
    sink = build_metrics_sink(cfg.output_dir) if rank == 0 else None
    try:
        trainer = Trainer(cfg)
        if cfg.ckpt.load:
            resume(trainer, cfg.ckpt.load)
        for rollout_id in tqdm(
            range(trainer.step, cfg.num_rollout),
            desc="train",
            disable=rank != 0,
            initial=trainer.step,
            total=cfg.num_rollout,
        ):
            metrics = trainer.train(read_rollout_data(cfg.load_debug_rollout_data, rollout_id))
            if sink is not None:
                sink.log(metrics, rollout_id)
                logger.info(
                    "rollout %d: loss %.5f, reward %.3f, grad norm %.4f, %.0f tokens/s",
                    rollout_id,
                    metrics["train/loss"],
                    metrics["train/reward_mean"],
                    metrics["train/grad_norm"],
                    metrics["perf/train_tokens_per_s"],
                )
            last = rollout_id + 1 == cfg.num_rollout
            ckpt = cfg.ckpt
            if ckpt.save and (last or (ckpt.save_interval and (rollout_id + 1) % ckpt.save_interval == 0)):
                save_checkpoint(trainer, ckpt.save)
    finally:
        if sink is not None:
            sink.close()
        shutdown_parallel()
