"""tinker-cookbook's recipes, unchanged, against ``inverted tinker-serve`` on SmolLM2-135M, offline.

The recipes run as their users run them (``python -m tinker_cookbook.recipes...``), changing only
documented config values: ``base_url``, ``model_name`` (the local checkpoint, whose tokenizer
``get_tokenizer`` reads offline), ``renderer_name``, ``loss_fn``, the data and ``load_checkpoint_path``.
They run through ``examples/tinker_recipe.py`` as the make targets run them, here as one SFT-then-RL
pipeline on one service: ``chat_sl`` for a few steps, then ``math_rl`` from its last checkpoint.
Short runs (a few steps each); ``make tinker-sl``, ``make tinker-rl`` and ``make tinker-rl-warm`` are
the full ones (docs/tinker.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tinker_cookbook

pytestmark = pytest.mark.slow

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline(smollm2, tmp_path_factory) -> Path:
    """The supervised recipe (3 steps), then the RL recipe (2 steps) from its checkpoint; the run folder."""
    out = tmp_path_factory.mktemp("cookbook")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "tinker_recipe.py"),
            "--checkpoint",
            str(smollm2),
            "--out",
            str(out),
            "--",
            "tinker_cookbook.recipes.chat_sl.train",
            "renderer_name=qwen3_instruct",
            f"dataset={CONVERSATIONS}",
            "batch_size=8",
            "max_steps=3",
            "learning_rate=1e-3",
            "lora_rank=8",
            "eval_every=0",
            "save_every=0",
            "--",
            "tinker_cookbook.recipes.math_rl.train",
            "env=arithmetic",
            "renderer_name=qwen3_instruct",
            "loss_fn=importance_sampling",
            "group_size=4",
            "groups_per_batch=4",
            "max_steps=2",
            "learning_rate=3e-4",
            "eval_every=0",
            "save_every=0",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    return out


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_the_supervised_recipe_trains_and_saves(pipeline):
    losses = [r["train_mean_nll"] for r in metrics(pipeline / "recipe-0") if "train_mean_nll" in r]
    assert len(losses) == 3 and all(0 < loss < 20 for loss in losses), losses
    # its last step saved the state and the sampler weights through save_weights / save_weights_for_sampler
    saved = [json.loads(line) for line in (pipeline / "recipe-0" / "checkpoints.jsonl").read_text().splitlines()]
    assert saved[-1]["state_path"].startswith("tinker://") and saved[-1]["sampler_path"].startswith("tinker://")


def test_the_rl_recipe_starts_from_that_checkpoint_and_samples_scores_and_trains(pipeline):
    steps = [r for r in metrics(pipeline / "recipe-1") if "env/all/reward/total" in r]
    assert len(steps) == 2, steps
    for row in steps:
        assert row["env/all/total_episodes"] == 16 and row["env/all/ac_tokens_per_turn"] > 0
    # load_checkpoint_path: the supervised run's state, whose training run the cookbook asked for the
    # renderer it was trained with (the REST read of tinker-serve) before building its client from it
    state = json.loads((pipeline / "recipe-0" / "checkpoints.jsonl").read_text().splitlines()[-1])["state_path"]
    log = (pipeline / "recipe-1" / "logs.log").read_text()
    assert f"Renderer metadata matches for checkpoint {state}: qwen3_instruct" in log, log[-3000:]
    assert f"Loaded weights from {state}" in log
