"""The bias of top-p and top-k sampling, and what replaying the sampling masks leaves of it. Prints JSON.

``make run``'s job (SmolLM2-135M-Instruct, reasoning-gym chain_sum, ``examples/smollm2.yaml``) runs a
few steps under each sampling setting, one after the other on the same machine:

- ``top_p=1``: the whole distribution, the baseline;
- ``top_p=0.9`` and ``top_k=50``, each token's kept set recorded (SGLang's sampling mask) and replayed
  by the trainer;
- ``top_p=0.9`` with ``--sampling-mask-top-k 0``: no masks, for the step time the replay costs.

Per setting, from the first step (the trainer's weights are the ones that sampled): the mean
|trainer - rollout| log-prob gap and the share of tokens whose ratio lies outside [0.9, 1.1], with
the masks replayed (what the loss uses) and, for the same tokens, without them (what a trainer that
ignores the cut would see); the mean kept-set size; the train step's time. The headline, as ratios in
the same run: each masked gap over ``top_p=1``'s (target <= 1.5), the unmasked gap over ``top_p=1``'s
(the bias the masks remove), and the step time with masks over without (target <= 1.10).

    python bench/sampling_mask.py [--steps 3] [--backend embedded|sglang]

Needs ``make run``'s model and data (``make models/smollm2-135m/config.json data/chain_sum.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "top_p_1": [],
    "top_p_0.9": ["--rollout-top-p", "0.9"],
    "top_k_50": ["--rollout-top-k", "50"],
    "top_p_0.9_unmasked": ["--rollout-top-p", "0.9", "--sampling-mask-top-k", "0"],
}


def run(name: str, flags: list[str], steps: int, backend: list[str]) -> list[dict]:
    out = ROOT / "runs" / "bench" / f"sampling-mask-{name}"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    command = [
        sys.executable,
        "-m",
        "inverted.cli",
        "train",
        "--config",
        str(ROOT / "examples/smollm2.yaml"),
        "--output-dir",
        str(out),
        "--num-rollout",
        str(steps),
        "--eval-interval",
        "0",
        "--dynamic-sampling-filter-path",
        "",
        *backend,
        *flags,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name}: the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    first = next(r for r in rows if "train/train_rollout_logprob_abs_diff" in r)
    steps = [r["perf/train_step_s"] for r in rows if "perf/train_step_s" in r]
    return {
        "logprob_gap": first["train/train_rollout_logprob_abs_diff"],
        "ratio_outside_0.9_1.1": first["train/rollout_ratio_outside"],
        "unmasked_logprob_gap": first.get("train/unmasked_logprob_abs_diff"),
        "unmasked_ratio_outside_0.9_1.1": first.get("train/unmasked_ratio_outside"),
        "kept_set_tokens": first.get("train/kept_set_tokens"),
        "kept_set_size_mean": first.get("train/kept_set_size_mean"),
        # the first step also warms the trainer up: the later ones' median
        "train_step_s": statistics.median(steps[1:] or steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", choices=["embedded", "sglang"], default="embedded")
    args = parser.parse_args()
    backend = (
        ["--rollout-backend", "sglang", "--rollout-sglang-python", str(ROOT / ".sglang/bin/python")]
        if args.backend == "sglang"
        else []
    )
    results = {name: summary(run(name, flags, args.steps, backend)) for name, flags in SETTINGS.items()}
    base = results["top_p_1"]["logprob_gap"]
    ratios = {}
    for name in ("top_p_0.9", "top_k_50"):
        ratios[f"{name}_masked_gap_over_top_p_1"] = results[name]["logprob_gap"] / base
        ratios[f"{name}_unmasked_gap_over_top_p_1"] = results[name]["unmasked_logprob_gap"] / base
    ratios["replay_step_time_over_none"] = (
        results["top_p_0.9"]["train_step_s"] / results["top_p_0.9_unmasked"]["train_step_s"]
    )
    print(
        json.dumps(
            {
                "backend": args.backend,
                "steps": args.steps,
                "settings": results,
                "ratios": ratios,
                "targets": {"masked_gap_over_top_p_1": "<= 1.5", "replay_step_time_over_none": "<= 1.10"},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
