"""Where metrics go: one ``MetricsSink`` interface (``log(metrics, step)``, ``close()``) with backends.

``plot_rewards`` draws a run's reward curves into a PNG at its end.
``JsonlSink`` (always on) appends one JSON object per step to ``metrics.jsonl``;
``TensorBoardSink`` writes event files when TensorBoard is installed; ``FanOut`` sends to several.
Metric names are ``owner/what_unit`` (``train/loss``, ``perf/tokens_per_s``); the step is the
rollout id. Only the controller and train rank 0 write to sinks.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        # JSON has no NaN or infinity: such a value is written as null rather than breaking the line.
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class FanOut:
    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def build_metrics_sink(output_dir: str | Path) -> FanOut:
    """JSONL at ``output_dir/metrics.jsonl``, plus TensorBoard under ``output_dir/tensorboard`` if available."""
    out = Path(output_dir)
    sinks: list[MetricsSink] = [JsonlSink(out / "metrics.jsonl")]
    try:
        sinks.append(TensorBoardSink(out / "tensorboard"))
    except ImportError:
        logger.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
    return FanOut(sinks)


def plot_rewards(metrics_path: str | Path, out: str | Path, keys: tuple[str, ...] = ("rollout/reward_mean", "eval/reward_mean", "eval/pass_rate",
                                                                      "eval/tool_call_rate")) -> Path | None:
    """Plot the reward curves of a run's ``metrics.jsonl`` into a PNG; None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    curves = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        axis.plot(*zip(*points), marker="o", markersize=3, label=name)
    axis.set_xlabel("rollout (an evaluation at N: the policy after N updates)")
    axis.set_ylabel("reward; pass rate and tool-call rate: shares")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return Path(out)
