"""Run a tinker-cookbook recipe, unchanged, against ``inverted tinker-serve`` on this machine.

    python examples/tinker_recipe.py --checkpoint models/smollm2-135m --out runs/tinker-rl -- \\
        tinker_cookbook.recipes.math_rl.train env=arithmetic renderer_name=qwen3_instruct ...

Starts the service on the checkpoint (its rollout servers behind the router), runs
``python -m RECIPE ARGS base_url=... model_name=CHECKPOINT log_path=OUT/recipe`` offline (the recipe's
tokenizer is the checkpoint's own), then stops the service. The recipe's metrics are in
``OUT/recipe/metrics.jsonl``, the service's log in ``OUT/serve.log``. Exits with the recipe's status.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from pathlib import Path

from inverted.processes import ManagedProcess, free_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="the model the service trains and serves")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--serve-args", default="", help="more flags of inverted tinker-serve, as one string")
    parser.add_argument("recipe", nargs=argparse.REMAINDER, help="-- MODULE key=value ...")
    args = parser.parse_args()
    recipe = args.recipe[1:] if args.recipe[:1] == ["--"] else args.recipe
    if not recipe:
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
        command = [
            sys.executable,
            "-m",
            recipe[0],
            *recipe[1:],
            f"base_url={url}",
            f"model_name={checkpoint}",
            f"log_path={out / 'recipe'}",
            "behavior_if_log_dir_exists=delete",
        ]
        print("+", " ".join(command), flush=True)
        return subprocess.run(command, env=env).returncode
    finally:
        serve.terminate()


if __name__ == "__main__":
    sys.exit(main())
