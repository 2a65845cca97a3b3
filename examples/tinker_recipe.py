"""Run tinker-cookbook recipes, unchanged, against ``inverted tinker-serve`` on this machine.

    python examples/tinker_recipe.py --checkpoint models/smollm2-135m --out runs/tinker-rl -- \\
        tinker_cookbook.recipes.math_rl.train env=arithmetic renderer_name=qwen3_instruct ...

Starts the service on the checkpoint (its rollout servers behind the router), runs
``python -m RECIPE ARGS base_url=... model_name=CHECKPOINT log_path=OUT/recipe`` offline (the recipe's
tokenizer is the checkpoint's own), then stops the service. The recipe's metrics are in
``OUT/recipe/metrics.jsonl``, the service's log in ``OUT/serve.log``. Exits with the recipe's status.

Several recipes, each after its own ``--``, run one after the other on the same service under the
same key, as a user's SFT-then-RL pipeline does: recipe ``i`` logs to ``OUT/recipe-i``, and each
after the first starts from the checkpoint the one before it saved last (``load_checkpoint_path``,
the ``state_path`` of the last row of its ``checkpoints.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from inverted.processes import ManagedProcess, free_port


def split_recipes(words: list[str]) -> list[list[str]]:
    """``-- A a=1 -- B b=2`` -> ``[[A, a=1], [B, b=2]]``."""
    recipes: list[list[str]] = []
    for word in words:
        if word == "--":
            recipes.append([])
        elif recipes:
            recipes[-1].append(word)
        else:
            recipes.append([word])
    return [r for r in recipes if r]


def last_checkpoint(log_path: Path) -> str:
    """The ``state_path`` the cookbook's ``checkpoint_utils`` recorded last under ``log_path``."""
    record = log_path / "checkpoints.jsonl"
    rows = record.read_text().splitlines() if record.exists() else []
    states = [row["state_path"] for row in map(json.loads, rows) if row.get("state_path")]
    if not states:
        raise SystemExit(f"{log_path}: the recipe saved no checkpoint to start the next one from")
    return states[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the model the service trains and serves")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--serve-args", default="", help="more flags of inverted tinker-serve, as one string")
    parser.add_argument("recipe", nargs=argparse.REMAINDER, help="-- MODULE key=value ... [-- MODULE key=value ...]")
    args = parser.parse_args()
    recipes = split_recipes(args.recipe)
    if not recipes:
        parser.error("name the recipe module after --")
    checkpoint, out = str(Path(args.checkpoint).resolve()), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ManagedProcess.spawn(
        "tinker-serve",
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "tinker-serve",
            "--hf-checkpoint",
            checkpoint,
            "--num-engines",
            "1",
            "--output-dir",
            str(out / "service"),
            "--tinker-port",
            str(port),
            *args.serve_args.split(),
        ],
        out / "serve.log",
        url,
    )
    try:
        serve.wait_healthy(300, path="/api/v1/healthz")
        env = {
            **os.environ,
            "TINKER_API_KEY": f"tml-{secrets.token_hex(8)}",
            "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }
        previous: Path | None = None
        for index, (module, *config) in enumerate(recipes):
            log_path = out / ("recipe" if len(recipes) == 1 else f"recipe-{index}")
            start = [f"load_checkpoint_path={last_checkpoint(previous)}"] if previous else []
            command = [
                sys.executable,
                "-m",
                module,
                *config,
                *start,
                f"base_url={url}",
                f"model_name={checkpoint}",
                f"log_path={log_path}",
                "behavior_if_log_dir_exists=delete",
            ]
            print("+", " ".join(command), flush=True)
            status = subprocess.run(command, env=env).returncode
            if status:
                return status
            previous = log_path
        return 0
    finally:
        serve.terminate()


if __name__ == "__main__":
    sys.exit(main())
