"""tinker-cookbook's recipes, unchanged, against ``inverted tinker-serve`` on SmolLM2-135M, offline.

The recipes run as their users run them (``python -m tinker_cookbook.recipes...``), changing only
documented config values: ``base_url``, ``model_name`` (the local checkpoint, whose tokenizer
``get_tokenizer`` reads offline), ``renderer_name``, ``loss_fn`` and the data. Short runs here
(a few steps each); ``make tinker-sl`` and ``make tinker-rl`` are the full ones (docs/tinker.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker_cookbook

from inverted.processes import ManagedProcess, free_port

pytestmark = pytest.mark.slow

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


@pytest.fixture(scope="module")
def service(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("cookbook")
    url = f"http://127.0.0.1:{free_port()}"
    proc = ManagedProcess.spawn(
        "tinker-serve",
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "tinker-serve",
            "--hf-checkpoint",
            str(smollm2),
            "--num-engines",
            "1",
            "--output-dir",
            str(out / "service"),
            "--tinker-port",
            url.rsplit(":", 1)[1],
        ],
        out / "serve.log",
        url,
    )
    try:
        proc.wait_healthy(180, path="/api/v1/healthz")
        yield url, smollm2, out
    finally:
        proc.terminate()


def recipe(service, module: str, name: str, *config: str) -> list[dict]:
    """Run ``python -m module`` as its users do; its metrics rows."""
    url, checkpoint, out = service
    log = out / name
    env = {
        **os.environ,
        "TINKER_API_KEY": f"tml-{name}",
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            f"base_url={url}",
            f"model_name={checkpoint}",
            f"log_path={log}",
            "behavior_if_log_dir_exists=delete",
            *config,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_the_supervised_recipe_trains_and_saves(service):
    rows = recipe(
        service,
        "tinker_cookbook.recipes.chat_sl.train",
        "sl",
        "renderer_name=qwen3_instruct",
        f"dataset={CONVERSATIONS}",
        "batch_size=8",
        "max_steps=3",
        "learning_rate=1e-3",
        "lora_rank=8",
        "eval_every=0",
        "save_every=0",
    )
    losses = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), rows
    # its last step saved the state and the sampler weights through save_weights / save_weights_for_sampler
    saved = [json.loads(line) for line in (service[2] / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["state_path"].startswith("tinker://") and saved[-1]["sampler_path"].startswith("tinker://")


def test_the_rl_recipe_samples_scores_and_trains(service):
    rows = recipe(
        service,
        "tinker_cookbook.recipes.math_rl.train",
        "rl",
        "env=arithmetic",
        "renderer_name=qwen3_instruct",
        "loss_fn=importance_sampling",
        "group_size=4",
        "groups_per_batch=4",
        "max_steps=2",
        "learning_rate=3e-4",
        "eval_every=0",
        "save_every=0",
    )
    steps = [r for r in rows if "env/all/reward/total" in r]
    assert len(steps) == 2, rows
    for row in steps:
        assert row["env/all/total_episodes"] == 16 and row["env/all/ac_tokens_per_turn"] > 0
