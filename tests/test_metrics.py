"""What a run's metrics leave: TensorBoard event files that TensorBoard reads, and the reward
picture (``reward.png``): its curves, its evaluation variants, and the stages of a recipe drawn
one after another."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.axes

from inverted.controller.config import JobConfig
from inverted.controller.main import stages
from inverted.metrics import build_metrics_sink, plot_rewards
from tests.test_config import parse


def write_metrics(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_tensorboard_reads_every_scalar_at_its_step_and_jsonl_has_the_same(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = build_metrics_sink(tmp_path)
    rows = {
        0: {"rollout/reward_mean": 0.25, "train/loss": 1.5},
        1: {"rollout/reward_mean": 0.75, "eval/pass_rate": 0.5},
    }
    for step, metrics in rows.items():
        sink.log(metrics, step)
    sink.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/pass_rate", "rollout/reward_mean", "train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(0, 1.5)]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, **metrics} for step, metrics in rows.items()]


def test_stages_are_drawn_one_after_another_with_the_variants_dashed(tmp_path, monkeypatch):
    first = write_metrics(
        tmp_path / "coached" / "metrics.jsonl",
        [
            {"step": 0, "eval/pass_rate": 0.0, "eval/coached/pass_rate": 0.1, "eval/coached/reward_mean": 0.1},
            {"step": 0, "rollout/reward_mean": 0.2, "train/loss": 3.0},
            {"step": 1, "rollout/reward_mean": 0.6},
            {"step": 2, "eval/pass_rate": 0.0, "eval/coached/pass_rate": 0.8},
        ],
    )
    second = write_metrics(
        tmp_path / "bootstrap" / "metrics.jsonl",
        [
            {"step": 0, "eval/pass_rate": 0.0, "eval/coached/pass_rate": 0.8},
            {"step": 1, "eval/pass_rate": 0.9, "eval/coached/pass_rate": 0.75},
        ],
    )
    drawn = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes, "plot", lambda self, *xy, **kw: drawn.append((xy, kw)) or real_plot(self, *xy, **kw)
    )

    out = plot_rewards([first, second], tmp_path / "reward.png")

    assert out == tmp_path / "reward.png" and out.read_bytes()[:4] == b"\x89PNG"
    by_points = {xy: kw for xy, kw in drawn}
    main_1, main_2, variant = (
        by_points[(0, 2), (0.0, 0.0)],
        by_points[(2, 3), (0.0, 0.9)],
        by_points[(0, 2), (0.1, 0.8)],
    )
    assert main_1["linestyle"] == main_2["linestyle"] == "-" and main_1["label"] == "eval/pass_rate"
    assert main_2["label"] is None and main_2["color"] == main_1["color"]  # stage 2 goes on where stage 1 ended
    assert variant["linestyle"] == "--" and variant["color"] == main_1["color"]  # dashed, in its main curve's colour
    assert ((0, 1), (0.2, 0.6)) in by_points  # the rollouts' reward; not the loss, nor a variant's reward
    assert len(drawn) == 5


def test_a_run_without_a_curve_draws_nothing(tmp_path):
    metrics = write_metrics(tmp_path / "run" / "metrics.jsonl", [{"step": 0, "train/loss": 1.0}])
    assert plot_rewards([metrics], tmp_path / "reward.png") is None and not (tmp_path / "reward.png").exists()


def test_a_bootstrapped_run_draws_the_run_it_learned_from_first(tmp_path):
    source = write_metrics(tmp_path / "stage1" / "metrics.jsonl", [{"step": 0, "eval/pass_rate": 0.0}])
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "p.jsonl", "--output-dir", str(tmp_path / "stage2")]
    alone, _ = parse(JobConfig, argv)
    assert stages(alone) == [tmp_path / "stage2" / "metrics.jsonl"]
    for given in (tmp_path / "stage1", tmp_path / "stage1" / "buffer.db"):  # a run directory or its buffer file
        bootstrapped, _ = parse(JobConfig, [*argv, "--bootstrap-from", str(given)])
        assert stages(bootstrapped) == [source, tmp_path / "stage2" / "metrics.jsonl"]
