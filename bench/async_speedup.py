"""Asynchronous against synchronous training on a long-tailed environment. Prints JSON.

Runs the real ``inverted train`` twice with the same model, engines, environment, dataset and
seed: once synchronous, once with ``--async-mode``. The environment is ``envs.long_tail``: two
model calls per episode around a simulated tool whose latency is long-tailed (most prompts
``--short-s`` seconds, about one in ten twenty times that); generation is real. The figure is
trained samples per second, the first step (warm-up) left out of both, and the ratio
``speedup = async / sync`` (target >= 2.5; AReaL reports 2.77x). Also reported per run: the
staleness of every trained group (from the buffer's file), what the buffer set aside, and the
reward curve.

    python bench/async_speedup.py [--model models/tiny-qwen2] [--steps 12] [--batch 8] [--n 4]
                                  [--staleness 4] [--short-s 0.25] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs import long_tail  # noqa: E402
from envs.datasets import write_dataset  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402


def dataset(args, out: Path) -> Path:
    path = write_dataset(long_tail.rows, out / "long_tail.jsonl", 512, seed=args.seed)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:  # rescale the environment's latencies to --short-s
        row["metadata"]["latency_s"] *= args.short_s / long_tail.SHORT_S
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_job(args, model: Path, data: Path, run_dir: Path, extra: list[str]) -> dict:
    command = [
        sys.executable,
        "-m",
        "inverted.cli",
        "train",
        "--hf-checkpoint",
        str(model),
        "--prompt-data",
        str(data),
        "--env-path",
        "envs.long_tail:episode",
        "--output-dir",
        str(run_dir),
        "--num-rollout",
        str(args.steps),
        "--rollout-batch-size",
        str(args.batch),
        "--n-samples-per-prompt",
        str(args.n),
        "--rollout-max-response-len",
        str(args.response_len),
        "--num-engines",
        str(args.engines),
        "--rollout-shuffle",
        "--rollout-seed",
        str(args.seed),
        "--lr",
        "1e-3",
        "--log-level",
        "warning",
        *extra,
    ]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = rows[1:]
    seconds = sum(r["time/step_s"] for r in measured)
    trained = sum(r["rollout/trained_samples"] for r in measured)
    with sqlite3.connect(run_dir / "buffer.db") as db:
        staleness = dict(
            db.execute(
                "SELECT staleness, COUNT(*) FROM groups WHERE state = 'consumed' GROUP BY staleness ORDER BY staleness"
            )
        )
    last = rows[-1]
    return {
        "samples_per_s": trained / seconds,
        "step_s_mean": seconds / len(measured),
        "staleness_histogram": {str(k): v for k, v in staleness.items()},
        "set_aside": {
            k.removeprefix("buffer/"): last.get(k, 0)
            for k in ("buffer/groups_dropped_stale", "buffer/groups_retried_stale", "buffer/groups_filtered")
        },
        "reward_curve": [
            round(r["rollout/reward_mean"], 4) if r.get("rollout/reward_mean") is not None else None for r in rows
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", default=None, help="HF checkpoint (default: a fresh tiny qwen2)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=4, help="--max-weight-staleness of the async run")
    parser.add_argument("--short-s", type=float, default=0.25, help="tool latency of a quick episode (slow: 20x)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="async-speedup-") as scratch:
        out = Path(args.out or scratch)
        out.mkdir(parents=True, exist_ok=True)
        model = Path(args.model) if args.model else Path(make_tiny_model(TinyModelConfig(out=str(out / "model"))))
        data = dataset(args, out)
        sync = run_job(args, model, data, out / "sync", [])
        async_ = run_job(
            args,
            model,
            data,
            out / "async",
            [
                "--async-mode",
                "--max-weight-staleness",
                str(args.staleness),
                "--partial-rollout",
                "--stale-policy",
                "retry",
            ],
        )
    print(
        json.dumps(
            {
                "bench": "async_speedup",
                "model": str(args.model or "tiny-qwen2"),
                "steps": args.steps,
                "samples_per_step": args.batch * args.n,
                "short_s": args.short_s,
                "long_s": args.short_s * long_tail.LONG_FACTOR,
                "max_weight_staleness": args.staleness,
                "sync": sync,
                "async": async_,
                "speedup": round(async_["samples_per_s"] / sync["samples_per_s"], 3),
                "target": 2.5,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
