"""Where metrics go: one ``MetricsSink`` interface (``log(metrics, step)``, ``close()``) with backends.

``plot_rewards`` draws a run's reward curves (and those of the runs it learned from) into a PNG at its end.
``JsonlSink`` (always on) appends one JSON object per step to ``metrics.jsonl``;
``TensorBoardSink`` writes event files when TensorBoard is installed; ``FanOut`` sends to several.
Metric names are ``owner/what_unit`` (``train/loss``, ``perf/tokens_per_s``); the step is the
rollout id. Only the controller and train rank 0 write to sinks.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
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
    """Scalars in TensorBoard event files, written by TensorBoard's own writer and protos: torch's
    ``SummaryWriter`` wraps the same ones, and would load torch into the controller for it (150 MB)."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
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


CURVES = ("rollout/reward_mean", "eval/reward_mean", "eval/pass_rate", "eval/tool_call_rate")
VARIANT_CURVES = ("pass_rate", "tool_call_rate")  # of each evaluation beside the main one (eval/NAME/...)


def plot_rewards(stages: Sequence[str | Path], out: str | Path) -> Path | None:
    """Plot the reward curves of runs' ``metrics.jsonl`` files into a PNG; None when there is nothing to plot.

    Several files are consecutive stages of one recipe (a run that learns from another run's episodes):
    each is drawn after the one before it, a dotted line between them. The main evaluation's curves are
    solid; those of the evaluations beside it (``--eval-variants``) dashed, in their main curve's colour.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}  # (metric, stage) -> points
    offset, starts = 0, []
    for index, stage in enumerate(stages):
        rows = [json.loads(line) for line in Path(stage).read_text().splitlines() if line.strip()]
        for row in rows:
            for key, value in row.items():
                if value is not None and (key in CURVES or _variant(key)):
                    curves.setdefault((key, index), []).append((offset + row["step"], value))
        starts.append(offset)
        offset += max((row["step"] for row in rows), default=0)
    if not curves:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    colours = {key: f"C{i}" for i, key in enumerate(CURVES)}
    labelled: set[str] = set()
    for name, index in sorted(curves, key=lambda c: (CURVES.index(c[0]) if c[0] in CURVES else len(CURVES), c)):
        main = name if name in CURVES else f"eval/{name.rsplit('/', 1)[1]}"
        axis.plot(
            *zip(*curves[name, index]),
            marker="o",
            markersize=3,
            color=colours[main],
            linestyle="-" if name in CURVES else "--",
            label=None if name in labelled else name,
        )
        labelled.add(name)
    if len(stages) > 1:
        for start, stage in zip(starts, stages):
            axis.axvline(start, color="grey", linestyle=":")
            axis.annotate(
                Path(stage).parent.name,
                (start, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(3, -12),
                textcoords="offset points",
                color="grey",
                fontsize="small",
            )
    axis.set_xlabel("rollout (an evaluation at N: the policy after N updates)")
    axis.set_ylabel("reward; pass rate and tool-call rate: shares")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return Path(out)


def _variant(key: str) -> bool:
    parts = key.split("/")
    return len(parts) == 3 and parts[0] == "eval" and parts[2] in VARIANT_CURVES
