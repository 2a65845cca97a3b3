"""``inverted view`` at scale: a filtered page of a 100k-Sample buffer, and a 4k-token trajectory in Chromium.

Writes a run directory with the real writers (the buffer's ``SQLiteStore``; the trainer's
``DetailsWriter`` for the served groups), starts ``inverted view`` on it as a user would, and measures:

- ``startup_s``: from the command to ``/health`` (the index takes in every stored Sample);
- ``filtered_page_ms``: each query of ``QUERIES`` through HTTP, median and worst of ``--repeats``
  (target: under 300 ms each). Baseline in the same run: the same answer without the index, every
  stored Sample parsed and filtered per request (what reading ``buffer.db`` directly costs);
- ``trajectory_page_ms``: Chromium (Debian's, via Playwright) from navigation to the page drawn
  (``body[data-ready]``), the 4,096-token multi-turn Sample (target: under 1 s), median of ``--repeats``;
- ``samples_page_ms``: the same for the Samples page with a filter in its address.

    python bench/view.py [--samples 100000] [--repeats 5] [--model models/smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import yaml

from inverted.buffer.datasets import PromptRecord
from inverted.buffer.store import SQLiteStore
from inverted.processes import free_port
from inverted.train.details import Detail, DetailsWriter
from inverted.types import Sample

N = 8  # samples per prompt, as the main job
LONG = 4096  # the long trajectory's tokens
QUERIES = {
    "reward range, completed, by mismatch": {
        "reward_min": 0.2,
        "reward_max": 0.8,
        "status": "completed",
        "sort": "mismatch",
        "descending": "true",
    },
    "steps 50-60, longest first": {"step_min": 50, "step_max": 60, "sort": "response_length", "descending": "true"},
    "zero-variance groups": {"zero_variance": "true"},
    "lowest reward": {"sort": "reward"},
    "a deep page": {"page": 1500, "sort": "staleness", "descending": "true"},
    "one group": {"group": 7000},
}


def sample(task: dict, rng: random.Random, vocab: int, step: int) -> Sample:
    prompt, n = [rng.randrange(100, vocab) for _ in range(48)], rng.randint(4, 128)
    mask = [1] * n
    for i in range(n // 3, n // 3 + n // 8):  # a tool result inside the response
        mask[i] = 0
    return Sample(
        group_index=task["group_index"],
        index=task["index"],
        prompt=task["prompt"],
        tokens=prompt + [rng.randrange(100, vocab) for _ in range(n)],
        response_length=n,
        loss_mask=mask,
        rollout_log_probs=[-rng.random() * 4 if m else 0.0 for m in mask],
        weight_versions=[str(step)] * n,
        reward=rng.choice([0.0, 0.0, 0.5, 1.0]),
        status=rng.choice([Sample.Status.COMPLETED] * 5 + [Sample.Status.TRUNCATED]),
        metadata={
            "turns": [
                {"start": 48, "end": 48 + n // 3, "finish_reason": "tool_calls"},
                {"start": 48 + n // 3 + n // 8, "end": 48 + n, "finish_reason": "stop"},
            ]
        },
    )


def long_sample(task: dict, rng: random.Random, vocab: int) -> Sample:
    """4,096 tokens: a 512-token prompt and eight turns, each followed by a 200-token tool result."""
    tokens = [rng.randrange(100, vocab) for _ in range(LONG)]
    prompt, n = 512, LONG - 512
    mask, turns, at = [], [], prompt
    for k in range(8):
        sampled = (n - 8 * 200) // 8
        turns.append({"start": at, "end": at + sampled, "finish_reason": "tool_calls" if k < 7 else "stop"})
        mask += [1] * sampled + [0] * 200
        at += sampled + 200
    mask += [1] * (n - len(mask))
    return Sample(
        group_index=task["group_index"],
        index=task["index"],
        prompt=task["prompt"],
        tokens=tokens,
        response_length=n,
        loss_mask=mask,
        rollout_log_probs=[-rng.random() * 4 if m else 0.0 for m in mask],
        weight_versions=["0"] * n,
        reward=1.0,
        status=Sample.Status.COMPLETED,
        metadata={"turns": turns},
    )


def write_run(run: Path, count: int, tokenizer: Path, vocab: int) -> tuple[int, int]:
    """The buffer and the trainer's rows of ``count`` Samples; (group, index) of the long one."""
    rng = random.Random(0)
    groups = count // N
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"hf_checkpoint": str(tokenizer)}}))
    store = SQLiteStore(
        str(run / "buffer.db"),
        n_samples_per_prompt=N,
        prompts=[PromptRecord(prompt=f"question {i}") for i in range(groups)],
    )
    details = DetailsWriter(run)
    long_key = (groups // 2, 0)
    for start in range(0, groups, 128):  # 128 groups a step: lease, submit, serve, train
        step = start // 128
        tasks = store.lease(min(128, groups - start) * N, "bench", 3600)
        made = [
            (
                t["lease_id"],
                long_sample(t, rng, vocab)
                if (t["group_index"], t["index"]) == long_key
                else sample(t, rng, vocab, step),
            )
            for t in tasks
        ]
        store.submit(made)
        batch = orjson.loads(store.next_batch(len(tasks) // N, step, None))
        rows = []
        for group in batch["groups"]:
            for data in group:
                rollout = np.asarray(data["rollout_log_probs"], dtype=np.float32)
                noise = np.random.default_rng(len(rows)).normal(0, 0.05, len(rollout))
                logp = rollout - np.abs(noise).astype(np.float32)
                adv = np.full(len(rollout), rng.uniform(-1, 1), dtype=np.float32)
                rows.append(
                    Detail(
                        data["group_index"],
                        data["index"],
                        0,
                        step,
                        float(np.abs(logp - rollout).mean()),
                        float(adv[0]),
                        logp,
                        adv,
                    )
                )
        details.write(rows)
    store.close()
    details.close()
    return long_key


def scan(db: Path, query: dict) -> float:
    """The baseline: answer ``query``'s filter by parsing every stored Sample (seconds)."""
    import sqlite3

    started = time.perf_counter()
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    kept = []
    for group, index, blob in connection.execute("SELECT group_index, sample_index, sample FROM samples"):
        data = orjson.loads(blob)
        reward = data["reward"]
        if query.get("reward_min", -1e9) <= reward <= query.get("reward_max", 1e9) and data["status"] == query.get(
            "status", data["status"]
        ):
            kept.append((group, index, data["response_length"]))
    kept.sort(key=lambda row: row[2])
    connection.close()
    return time.perf_counter() - started


def browser_ms(url: str, repeats: int) -> float:
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
    ]
    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args)
        for _ in range(repeats + 1):  # the first warms the browser's cache of the scripts
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            started = time.perf_counter()
            page.goto(url)
            page.wait_for_selector("body[data-ready]")
            page.evaluate("new Promise(requestAnimationFrame)")  # drawn, not only built
            times.append((time.perf_counter() - started) * 1000)
            page.close()
        browser.close()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="models/smollm2-135m", help="whose tokenizer names the tokens")
    args = parser.parse_args()
    from inverted.hf_checkpoint import load_tokenizer

    vocab = len(load_tokenizer(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        started = time.perf_counter()
        group, index = write_run(run, args.samples, Path(args.model).resolve(), vocab)
        written_s = time.perf_counter() - started
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        started = time.perf_counter()
        server = subprocess.Popen(
            [sys.executable, "-m", "inverted.cli", "view", str(run), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.05)
            startup_s = time.perf_counter() - started
            pages = {}
            with httpx.Client(base_url=url, timeout=60) as client:
                for name, query in QUERIES.items():
                    times = []
                    for _ in range(args.repeats):
                        begun = time.perf_counter()
                        reply = client.get("/api/samples", params=query)
                        times.append((time.perf_counter() - begun) * 1000)
                        reply.raise_for_status()
                    pages[name] = {
                        "median_ms": round(statistics.median(times), 1),
                        "worst_ms": round(max(times), 1),
                        "matched": reply.json()["total"],
                    }
                begun = time.perf_counter()
                client.get("/api/trajectory", params={"group": group, "index": index}).raise_for_status()
                trajectory_api_ms = (time.perf_counter() - begun) * 1000
            baseline_ms = scan(run / "buffer.db", QUERIES["reward range, completed, by mismatch"]) * 1000
            trajectory_ms = browser_ms(f"{url}/trajectory?group={group}&index={index}", args.repeats)
            samples_ms = browser_ms(
                f"{url}/samples?reward_min=0.2&status=completed&sort=mismatch&descending=true", args.repeats
            )
        finally:
            server.terminate()
            server.wait(10)
    worst = max(p["worst_ms"] for p in pages.values())
    print(
        json.dumps(
            {
                "samples": args.samples,
                "buffer_written_s": round(written_s, 1),
                "startup_s": round(startup_s, 2),
                "filtered_page_ms": pages,
                "filtered_page_worst_ms": worst,
                "filtered_page_target_ms": 300,
                "baseline_scan_ms": round(baseline_ms, 1),
                "speedup_over_scan": round(baseline_ms / pages["reward range, completed, by mismatch"]["median_ms"], 1),
                "trajectory_tokens": LONG,
                "trajectory_api_ms": round(trajectory_api_ms, 1),
                "trajectory_page_ms": round(trajectory_ms, 1),
                "trajectory_page_target_ms": 1000,
                "samples_page_ms": round(samples_ms, 1),
                "met": worst < 300 and trajectory_ms < 1000,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
