"""Where the time of a sync RL step goes, and how much of it the framework adds. Prints JSON.

Runs the real ``inverted train`` (Ray, sgl-router, embedded engines, proxy, buffer, Megatron
trainer) on the ``small`` model with the ``letters`` environment and ``--rollout-max-response-len``
tokens per reply, then reads each step's phase times from ``metrics.jsonl``:

- ``rollout_s``: leasing excluded, the rollout function's episodes (generation + proxy + env);
- ``train_s``: the trainer's step as the controller sees it (Ray call included);
- ``sync_s``: pushing the new weights into every server;
- ``idle_s``: the rest of the step (lease, buffer submit and batch, metrics).

The baseline, in the same run: after the job, the same engines behind the same router are
started again and every step's generation is replayed straight to the router's ``/generate``
(the recorded prompt ids, the recorded number of output tokens, all requests at once, each step
from an empty prefix cache as the job's weight sync leaves it): that is the step's **pure
generation** time. The pure **training** time is the trainer's own measure of
its step (``perf/train_step_s``). ``framework_overhead`` is the fraction of the step that is
neither: 1 - (generation + training) / step. Target <= 0.10. The first step (warm-up) is left out.
``longest_model_call_s`` (the slowest model call of a step, as the proxy timed it) tells how much
of the rollout phase's excess is inside the generation path rather than around it.

    python bench/rl_step.py [--model models/small-qwen2] [--steps 4] [--batch 8] [--n 4] [--response-len 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.datasets import write_dataset  # noqa: E402
from envs.letters import rows as letters_rows  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.rollout.config import ServersConfig  # noqa: E402
from inverted.rollout.servers import RolloutServers  # noqa: E402
from inverted.rollout.sglang_client import SGLangClient  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402
from inverted.types import Sample  # noqa: E402


def run_job(args, model: Path, out: Path) -> None:
    data = write_dataset(letters_rows, out / "letters.jsonl", 256)
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
        "envs.letters:episode",
        "--output-dir",
        str(out / "run"),
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
        "--lr",
        "1e-5",
        "--log-level",
        "warning",
    ]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def recorded_requests(db: Path) -> tuple[dict[int, list[tuple[list[int], int]]], dict[int, float]]:
    """Per rollout id: (prompt ids, output tokens) of every model call the episodes made, and the
    longest call as the proxy timed it (its /generate round trip)."""
    steps: dict[int, list[tuple[list[int], int]]] = {}
    longest: dict[int, float] = {}
    with sqlite3.connect(db) as conn:
        for (blob,) in conn.execute("SELECT sample FROM samples"):
            sample = Sample.from_json(blob)
            step = sample.metadata["rollout_id"]
            for turn in sample.metadata.get("turns", []):
                steps.setdefault(step, []).append((sample.tokens[: turn["start"]], turn["completion_tokens"]))
                longest[step] = max(longest.get(step, 0.0), turn["latency_s"])
    return steps, longest


async def replay(args, model: Path, log_dir: Path, steps: dict[int, list[tuple[list[int], int]]]) -> dict[int, float]:
    """Seconds to generate each step's calls straight through the router (all at once, fixed lengths)."""
    config = ServersConfig(hf_checkpoint=str(model), num_engines=args.engines, log_dir=str(log_dir))
    seconds = {}
    async with (
        RolloutServers(config) as servers,
        SGLangClient(servers.router_url) as client,
        contextlib.AsyncExitStack() as stack,
    ):
        engines = [await stack.enter_async_context(SGLangClient(url)) for url in servers.engine_urls]
        for step, calls in sorted(steps.items()):
            # The job's weight sync flushed every server's prefix cache before this rollout (the cached
            # KV was the old policy's); the replay starts as cold, or it would reuse the previous
            # step's prompts (the letters task has two).
            if not all(await asyncio.gather(*(engine.flush_cache() for engine in engines))):
                raise RuntimeError("an engine refused /flush_cache between replayed steps")
            started = time.perf_counter()
            await asyncio.gather(
                *(
                    client.generate(
                        {
                            "input_ids": ids,
                            "sampling_params": {
                                "max_new_tokens": length,
                                "min_new_tokens": length,
                                "ignore_eos": True,
                                "temperature": 1.0,
                            },
                        }
                    )
                    for ids, length in calls
                )
            )
            seconds[step] = time.perf_counter() - started
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "small-qwen2"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=64)
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="small"))
    with tempfile.TemporaryDirectory(prefix="rl-step-") as scratch:
        out = Path(scratch)
        run_job(args, model, out)
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()][1:]
        calls, longest_call = recorded_requests(out / "run" / "buffer.db")
        generation = asyncio.run(replay(args, model, out / "replay-logs", calls))

    def median(values) -> float:
        return round(statistics.median(values), 3)

    step = [r["time/step_s"] for r in rows]
    train_compute = [r["perf/train_step_s"] for r in rows]
    pure = [generation[r["step"]] + t for r, t in zip(rows, train_compute)]
    result = {
        "bench": "rl_step",
        "model": model.name,
        "steps_measured": len(rows),
        "episodes_per_step": args.batch * args.n,
        "response_len": args.response_len,
        "engines": args.engines,
        "phases_s": {
            "rollout": median(r["time/rollout_s"] for r in rows),
            "train": median(r["time/train_s"] for r in rows),
            "sync": median(r["time/sync_s"] for r in rows),
            "idle": median(r["time/step_s"] - r["time/rollout_s"] - r["time/train_s"] - r["time/sync_s"] for r in rows),
            "step": median(step),
        },
        "baseline_s": {"generation": median(generation[r["step"]] for r in rows), "training": median(train_compute)},
        "longest_model_call_s": median(longest_call[r["step"]] for r in rows),
        "framework_overhead": round(1 - statistics.median(p / s for p, s in zip(pure, step)), 3),
        "target": "framework_overhead <= 0.10",
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
