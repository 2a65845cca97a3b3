"""What every step does with its batch before training, whichever source served it.

``prepare_batch`` measures the batch beside the Samples played for it (the ``rollout/*`` metrics:
rewards, lengths, statuses, partial rollouts, kept sets, episodes' turns and tool calls), and runs
the driver's plug-ins that read a batch: ``--rollout-sample-filter-path`` (which Samples the loss
leaves out), ``--save-debug-rollout-data`` and slime's rollout log function. ``episode_metrics``
measures proxy-recorded episodes the same way for an evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inverted.buffer.client import BatchRef
from inverted.controller.config import JobConfig
from inverted.controller.job import Job
from inverted.controller.rollouts import job_flags, save_rollout_data
from inverted.plugins import Plugins
from inverted.types import Sample, reward_number

USABLE = (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)


async def prepare_batch(
    cfg: JobConfig, job: Job, plugins: Plugins, step: int, played: list[Sample], batch: BatchRef, seconds: float
) -> tuple[BatchRef, dict[str, float]]:
    """What every step does with its batch before training: the batch is measured beside the Samples
    played for it (``seconds`` of rollout). Only where a plug-in of the driver's reads the batch's
    Samples does the driver read them from the buffer: ``--rollout-sample-filter-path`` marks those to
    leave out of the loss (the batch then names them, for the ranks), ``--save-debug-rollout-data``
    writes them, and a slime rollout log function has the last say over the metrics."""
    metrics = rollout_metrics(cfg.train.loss.reward_key, played, batch.num_samples)
    if cfg.rollout.biased_ratios:  # said on every row: the ratios of this run's cut sampling are not exact
        metrics["rollout/biased_ratios"] = 1.0
    if not (plugins.sample_filter or plugins.rollout_log or cfg.rollout.save_debug_rollout_data):
        return batch, metrics
    samples = await job.ledger.samples(batch)
    if removed := filter_samples(plugins, samples):
        batch = dataclasses.replace(batch, removed=removed)
    save_rollout_data(cfg.rollout.save_debug_rollout_data, step, samples, job_flags(cfg))
    return batch, log_rollout(plugins, step, samples, metrics, seconds)


def filter_samples(plugins: Plugins, samples: list[Sample]) -> frozenset[int]:
    """``--rollout-sample-filter-path`` sees the batch by group and sets ``remove_sample`` on the Samples
    the trainer is to leave out of the loss; their positions in the batch."""
    if plugins.sample_filter is None:
        return frozenset()
    groups: dict[Any, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_index, []).append(sample)
    plugins.sample_filter(list(groups.values()))
    return frozenset(position for position, s in enumerate(samples) if s.remove_sample)


def log_rollout(
    plugins: Plugins, rollout_id: int, samples: list[Sample], metrics: dict[str, float], seconds: float
) -> dict[str, float]:
    """``--custom-rollout-log-function-path`` sees the rollout; if it returns True, the default
    ``rollout/*`` metrics are left out of the row (slime: it did the logging itself)."""
    if plugins.rollout_log is None:
        return metrics
    if plugins.rollout_log(rollout_id, samples, dict(metrics), seconds):
        return {k: v for k, v in metrics.items() if not k.startswith("rollout/")}
    return metrics


def rollout_metrics(reward_key: str | None, played: list[Sample], trained: int) -> dict[str, float]:
    """The Samples played for a step, and how many it trains on."""
    usable = [s for s in played if s.status in USABLE]
    # a raw reward slime's post-process makes a number in the trainer (OPD's: the teacher's answer) is not
    # averaged here; the trainer refuses one it cannot read
    rewards = [r for r in (reward_number(s.reward, reward_key) for s in usable) if r is not None]
    lengths = [s.response_length for s in usable]
    return {
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "rollout/samples": float(len(played)),
        "rollout/trained_samples": float(trained),
        "rollout/failed": float(sum(s.status == Sample.Status.FAILED for s in played)),
        # episodes whose proxy session was lost (a restarted proxy): their tasks are played again
        "rollout/aborted": float(sum(s.status == Sample.Status.ABORTED for s in played)),
        "rollout/truncated": float(sum(s.status == Sample.Status.TRUNCATED for s in played)),
        "rollout/response_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "rollout/response_tokens": float(sum(sum(s.loss_mask) for s in usable)),
        # Partial rollouts: model calls that a weight update interrupted and that went on from their
        # tokens, and the samples whose tokens therefore carry more than one weight version.
        "rollout/resumed_calls": float(sum(t.get("resumes", 0) for s in usable for t in s.metadata.get("turns", []))),
        "rollout/mixed_version_samples": float(sum(len(set(s.weight_versions)) > 1 for s in usable)),
        # tokens sampled from a cut distribution whose set was recorded (sampling masks), for the trainer to replay
        "rollout/kept_set_tokens": float(
            sum(
                sum(b > a for a, b in zip(s.rollout_top_p_token_offsets, s.rollout_top_p_token_offsets[1:]))
                for s in usable
                if s.rollout_top_p_token_offsets
            )
        ),
    } | episode_metrics("rollout", usable)


def episode_metrics(prefix: str, samples: list[Sample]) -> dict[str, float]:
    """The shape of proxy-recorded episodes (``metadata.turns``): model calls per episode, and the
    share of episodes with at least one well-formed tool call (a turn the tool parser turned into
    ``tool_calls``). Nothing for rollouts that record no turns (single_turn, slime's)."""
    turns = [s.metadata["turns"] for s in samples if s.metadata.get("turns")]
    if not turns:
        return {}
    return {
        f"{prefix}/turns_mean": sum(map(len, turns)) / len(turns),
        f"{prefix}/tool_call_rate": sum(any(t["finish_reason"] == "tool_calls" for t in ts) for ts in turns)
        / len(turns),
    }
