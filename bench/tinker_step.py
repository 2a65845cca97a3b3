"""One RL step driven through the Tinker API, against the same step as an ``inverted train`` job. Prints JSON.

The step has the cookbook's shape (``rl_loop``, ``math_rl``): save the weights for a sampler,
sample ``--n`` replies to each of ``--batch`` prompts, score them, centre the rewards per group,
``forward_backward`` with ``importance_sampling`` on every reply token, ``optim_step``. The client
is the official SDK against ``inverted tinker-serve``; the task is the demo's letters task
(``envs/letters.py``), its prompts rendered by the checkpoint's chat template.

The baseline, in the same run: ``inverted train`` on the same model, task, batch, group size,
reply length, LoRA rank and number of servers (the job: Ray, the proxy, the buffer, the
controller's loop). Both report the median step time after the first (warm-up) step, and reply
tokens per second of step. ``ratio`` is the job's step time over the Tinker step's: above 1,
the Tinker loop is faster.

    python bench/tinker_step.py [--model models/small-qwen2] [--steps 4] [--batch 8] [--n 4] [--response-len 16]

(#75 names it ``bench/tinker.py``: run by its path, a script of that name is first on ``sys.path`` and
would be what ``import tinker`` finds, not the SDK.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.datasets import write_dataset  # noqa: E402
from envs.letters import rows as letters_rows  # noqa: E402
from envs.letters import score  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402

LORA_RANK = 16
LEARNING_RATE = 1e-4


def run_job(args, model: Path, data: Path, out: Path) -> list[dict]:
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
        str(out),
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
        "--lora-rank",
        str(LORA_RANK),
        "--lr",
        str(LEARNING_RATE),
        "--log-level",
        "warning",
    ]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"time/step_s"' in line]


async def tinker_steps(args, model: Path, prompts: list[dict], url: str) -> list[tuple[float, int, dict]]:
    """(seconds, reply tokens, seconds by phase) of each step of the SDK's loop."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    service = tinker.ServiceClient(base_url=url, api_key=f"tml-{secrets.token_hex(8)}")
    training = await service.create_lora_training_client(base_model=str(model), rank=LORA_RANK)
    params = types.SamplingParams(max_tokens=args.response_len, temperature=1.0)
    steps = []
    for step in range(args.steps):
        batch = prompts[step * args.batch : (step + 1) * args.batch]
        started = time.perf_counter()
        sampler = await training.save_weights_and_get_sampling_client()
        saved = time.perf_counter()
        rendered = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": row["input"]}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            for row in batch
        ]
        answers = await asyncio.gather(
            *(
                sampler.sample(prompt=types.ModelInput.from_ints(ids), num_samples=args.n, sampling_params=params)
                for ids in rendered
            )
        )
        sampled = time.perf_counter()
        data, replied = [], 0
        for ids, row, answer in zip(rendered, batch, answers):
            rewards = [
                score(tokenizer.decode(s.tokens, skip_special_tokens=True), row["label"]) for s in answer.sequences
            ]
            mean = sum(rewards) / len(rewards)
            for sequence, reward in zip(answer.sequences, rewards):
                tokens = list(ids) + list(sequence.tokens)
                prompt_positions = len(ids) - 1
                replied += len(sequence.tokens)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.array(tokens[1:], np.int64),
                            "logprobs": np.array([0.0] * prompt_positions + list(sequence.logprobs), np.float32),
                            "advantages": np.array(
                                [0.0] * prompt_positions + [reward - mean] * len(sequence.tokens), np.float32
                            ),
                        },
                    )
                )
        forward = training.forward_backward(data, "importance_sampling")
        stepped = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        await forward
        await stepped
        done = time.perf_counter()
        steps.append(
            (
                done - started,
                replied,
                {"save_for_sampler": saved - started, "sample": sampled - saved, "train": done - sampled},
            )
        )
    await service.close("success")
    return steps


def run_tinker(args, model: Path, prompts: list[dict], out: Path) -> list[tuple[float, int, dict]]:
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
            str(model),
            "--num-engines",
            str(args.engines),
            "--output-dir",
            str(out),
            "--tinker-port",
            str(port),
            "--lora-alpha",
            "32",
        ],
        out / "serve.log",
        url,
    )
    try:
        serve.wait_healthy(300, path="/api/v1/healthz")
        os.environ["TINKER_TELEMETRY"] = "0"
        return asyncio.run(tinker_steps(args, model, prompts, url))
    finally:
        serve.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "small-qwen2"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--response-len", type=int, default=16)
    parser.add_argument("--engines", type=int, default=1)
    args = parser.parse_args()
    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="small"))
    with tempfile.TemporaryDirectory(prefix="tinker-bench-") as scratch:
        out = Path(scratch)
        data = write_dataset(letters_rows, out / "letters.jsonl", args.steps * args.batch)
        prompts = [json.loads(line) for line in data.read_text().splitlines()]
        tinker = run_tinker(args, model, prompts, out / "tinker")[1:]
        job = run_job(args, model, data, out / "job")[1:]

    def median(values) -> float:
        return round(statistics.median(values), 3)

    tinker_step = median(s for s, _, _ in tinker)
    job_step = median(r["time/step_s"] for r in job)
    result = {
        "bench": "tinker_step",
        "model": model.name,
        "steps_measured": len(tinker),
        "episodes_per_step": args.batch * args.n,
        "response_len": args.response_len,
        "engines": args.engines,
        "lora_rank": LORA_RANK,
        "tinker": {
            "step_s": tinker_step,
            "reply_tokens_per_s": median(n / s for s, n, _ in tinker),
            "phases_s": {name: median(p[name] for _, _, p in tinker) for name in tinker[0][2]},
        },
        "job": {
            "step_s": job_step,
            "reply_tokens_per_s": median(r["rollout/response_tokens"] / r["time/step_s"] for r in job),
            "phases_s": {name: median(r[f"time/{name}_s"] for r in job) for name in ("rollout", "train", "sync")},
        },
        "ratio": round(job_step / tinker_step, 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
