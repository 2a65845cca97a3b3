"""Evaluation: the policy on ``--eval-prompt-data``, through no buffer (nothing here is trained on).

``evaluate`` runs before the first step, every ``--eval-interval`` steps and after the last (the
loop logs each as a row of its own): greedy unless ``--eval-temperature``, once for the main evaluation
(``eval/*``) and once per ``--eval-variants`` entry (``eval/NAME/*``). An eval function may answer
per dataset (``EvalResults``, slime's ``RolloutFnEvalOutput``), and is then logged per dataset as
slime logs it.
"""

from __future__ import annotations

from pathlib import Path

from inverted.controller.batches import USABLE, episode_metrics
from inverted.controller.config import JobConfig
from inverted.controller.job import Job
from inverted.controller.rollouts import context, read_prompts, run_evaluation
from inverted.errors import ConfigError
from inverted.plugins import EvalResults, Plugins
from inverted.types import Sample, Task


async def evaluate(cfg: JobConfig, job: Job, plugins: Plugins, rollout_id: int) -> dict[str, float]:
    """The rollout function on ``--eval-prompt-data`` at ``--eval-temperature`` (through no buffer:
    nothing here is trained on), once for the main evaluation (``eval/*``) and once per
    ``--eval-variants`` entry (``eval/NAME/*``). A pass is a sample whose reward reaches 1, the
    graders' "correct"."""
    data = cfg.rollout.eval_prompt_data
    if not data:  # JobConfig.validate asks for it with --eval-interval
        raise ConfigError("--eval-prompt-data: no evaluation dataset")
    records = read_prompts(cfg.buffer, data)
    n = cfg.rollout.n_samples_per_eval_prompt
    tasks = [
        Task(
            lease_id="eval",
            group_index=i,
            index=i * n + j,
            prompt_index=i,
            prompt=r.prompt,
            label=r.label,
            metadata=r.metadata,
            tools=r.tools,
        )
        for i, r in enumerate(records)
        for j in range(n)
    ]
    played = {
        variant: await run_evaluation(
            context(cfg, job, plugins, rollout_id, evaluation=True, variant=variant), plugins, tasks
        )
        for variant in plugins.eval_envs or [""]
    }
    metrics = {
        key: value
        for variant, answer in played.items()
        for key, value in eval_metrics(
            f"eval/{variant}" if variant else "eval", cfg.train.loss.reward_key, answer
        ).items()
    }
    return log_evaluation(cfg, plugins, rollout_id, played[""], metrics)


def eval_metrics(prefix: str, reward_key: str | None, answer: list[Sample] | EvalResults) -> dict[str, float]:
    """Reward, pass rate and episodes over every Sample; for ``EvalResults`` also each dataset's, as slime
    logs them (``eval/NAME``: its mean reward, ``eval/NAME-truncated_ratio``), and the function's own."""
    if not isinstance(answer, EvalResults):
        return sample_metrics(prefix, reward_key, answer)
    samples = [s for result in answer.datasets.values() for s in result.samples]
    metrics = sample_metrics(prefix, reward_key, samples) if samples else {}
    for name, result in answer.datasets.items():
        if result.rewards:
            metrics[f"{prefix}/{name}"] = sum(result.rewards) / len(result.rewards)
        if result.truncated:
            metrics[f"{prefix}/{name}-truncated_ratio"] = sum(result.truncated) / len(result.truncated)
    return metrics | answer.metrics


def sample_metrics(prefix: str, reward_key: str | None, samples: list[Sample]) -> dict[str, float]:
    usable = [s for s in samples if s.status in USABLE]
    rewards = [s.scalar_reward(reward_key) for s in usable]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    return {
        f"{prefix}/reward_mean": mean(rewards),
        f"{prefix}/pass_rate": mean([float(r >= 1.0) for r in rewards]),
        f"{prefix}/failed": float(len(samples) - len(rewards)),
    } | episode_metrics(prefix, usable)


def log_evaluation(
    cfg: JobConfig, plugins: Plugins, rollout_id: int, answer: list[Sample] | EvalResults, metrics: dict[str, float]
) -> dict[str, float]:
    """``--custom-eval-rollout-log-function-path`` sees the main evaluation; if it returns True, the
    default ``eval/*`` metrics are left out of the row (slime: it did the logging itself)."""
    if plugins.eval_log is not None:  # {dataset: {rewards, truncated, samples}}, as slime's
        if isinstance(answer, EvalResults):
            data = {
                name: {"rewards": r.rewards, "truncated": r.truncated, "samples": r.samples}
                for name, r in answer.datasets.items()
            }
        else:
            usable = [s for s in answer if s.status in USABLE]
            data = {
                Path(cfg.rollout.eval_prompt_data or "eval").stem: {
                    "rewards": [s.scalar_reward(cfg.train.loss.reward_key) for s in usable],
                    "truncated": [s.status == Sample.Status.TRUNCATED for s in usable],
                    "samples": usable,
                }
            }
        if plugins.eval_log(rollout_id, data, dict(metrics)):
            return {}
    return metrics
