"""A 32k-token episode end to end: recorded through the proxy, trained one step. Prints JSON.

A coding agent's episode reads files: each tool result is long, and the history grows to the
model's context. Here a tiny model with a 64k context (``make-tiny-model --max-positions 65536``)
runs ``--episodes`` such episodes at once through the real stack (embedded engine, sgl-router,
proxy): every turn resends the whole history with ``tools``, the reply comes back as a call of
``lookup`` (the bench's tool parser, as in ``proxy_overhead.py --session-turns``: a random model
writes no calls), and the tool answers with about ``--tool-tokens`` tokens of text, until the
episode holds ``--length`` tokens. The episodes form one group (rewards 1 and 0), and the trainer
(a process of its own, as in a job) trains one step on their Samples.

What it checks and reports:
- **recorded exactly**: each Sample's loss mask covers exactly its turns' sampled tokens, and the
  trainer's recomputed log-probs of those tokens equal the engine's recorded ones
  (``train/train_rollout_logprob_abs_diff``: one wrong or shifted token would show at once);
- each turn's proxy latency, and the share of the history it resent that the engine's prefix cache
  served (``usage.prompt_tokens_details.cached_tokens``);
- each process's peak resident memory (``VmHWM``): engine, router, proxy, trainer; and the step time.

    python bench/long_episode.py                    # two 32,768-token episodes, one step
    python bench/long_episode.py --length 8192      # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy_overhead import LOOKUP, start_stack  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402


def vm_hwm_mb(pid: int | str = "self") -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return round(int(line.split()[1]) / 1024, 1)


def tool_output(episode: int, turn: int, tokens: int) -> str:
    """About ``tokens`` tokens of file-like text (the tiny tokenizer: about 3 characters a token)."""
    lines, size = [], 0
    while size < 3 * tokens:
        line = f"{episode:02d}.{turn:03d}.{len(lines):04d}: value = compute(item_{len(lines) * 7 % 97}, limit={turn})"
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


async def episode(http: httpx.AsyncClient, proxy_url: str, index: int, args) -> tuple[dict, list[dict]]:
    """One episode until it holds ``--length`` tokens: its Sample, and each turn's latency and usage."""
    # no min_tokens: the engine would mask the end-of-turn token, and its log-probs would not be the policy's
    sampling = {"max_tokens": args.reply_tokens, "seed": index}
    session = (await http.post(proxy_url + "/sessions", json={"sampling_params": sampling})).json()
    messages = [
        {"role": "system", "content": "You are a coding agent. Read the files you need, then answer."},
        {"role": "user", "content": f"Why does job {index} fail?"},
    ]
    turns = []
    while True:
        started = time.perf_counter()
        reply = await http.post(
            session["base_url"] + "/chat/completions", json={"model": "m", "messages": messages, "tools": LOOKUP}
        )
        assert reply.status_code == 200, reply.text[:500]
        usage = reply.json()["usage"]
        turns.append(
            {
                "latency_s": round(time.perf_counter() - started, 4),
                "prompt_tokens": usage["prompt_tokens"],
                "total_tokens": usage["total_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            }
        )
        if usage["total_tokens"] >= args.length:
            break
        message = reply.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        messages += [
            {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
            {"role": "tool", "tool_call_id": call["id"], "content": tool_output(index, len(turns), args.tool_tokens)},
        ]
    await http.post(f"{proxy_url}/sessions/{session['session_id']}/reward", json={"reward": float(index == 0)})
    (sample,) = (await http.post(f"{proxy_url}/sessions/{session['session_id']}/finish")).json()["samples"]
    return sample, turns


def mask_is_exact(sample: dict) -> bool:
    """The loss mask is 1 on exactly the turns' sampled tokens (tool results and glue: 0)."""
    prompt = len(sample["tokens"]) - sample["response_length"]
    expected = [0] * sample["response_length"]
    for turn in sample["metadata"]["turns"]:
        expected[turn["start"] - prompt : turn["end"] - prompt] = [1] * (turn["end"] - turn["start"])
    return sample["loss_mask"] == expected


def train_child(model: str, samples_path: str) -> None:
    """The trainer in this process: build it, train one step on the Samples; JSON to stdout."""

    from inverted.config import from_flags
    from inverted.train.config import TrainConfig
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer
    from inverted.types import Sample

    os.environ.update(RANK="0", WORLD_SIZE="1")
    samples = [Sample.from_json(s) for s in json.loads(Path(samples_path).read_text())]
    cfg = from_flags(TrainConfig, hf_checkpoint=model, lr=1e-5)
    init_parallel(cfg.parallel, cfg.seed)
    trainer = Trainer(cfg)
    started = time.perf_counter()
    metrics = trainer.train(samples)
    seconds = time.perf_counter() - started
    shutdown_parallel()
    keep = ("logprob_abs_diff", "loss", "grad_norm", "entropy", "advantage", "tokens")
    print(
        json.dumps(
            {
                "peak_rss_mb": vm_hwm_mb(),
                "step_s": round(seconds, 2),
                "metrics": {k: v for k, v in metrics.items() if any(word in k for word in keep)},
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/tiny-qwen2-64k", help="checkpoint (made if missing: tiny, 64k)")
    parser.add_argument("--length", type=int, default=32768, help="tokens each episode grows to")
    parser.add_argument("--episodes", type=int, default=2, help="episodes at once (one group)")
    parser.add_argument("--tool-tokens", type=int, default=1500, help="about this many tokens per tool result")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens sampled per call")
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--log-dir", default="runs/bench-long-episode")
    parser.add_argument("--train-child", help=argparse.SUPPRESS)  # the trainer's process: a Samples file
    args = parser.parse_args()
    if args.train_child:
        return train_child(args.model, args.train_child)
    model = Path(args.model)
    if not (model / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model), preset="tiny", max_positions=65536))
    context = ("--context-length", "65536")
    procs = start_stack(
        model,
        Path(args.log_dir),
        engine_args=("--num-threads", str(args.threads), *context),
        proxy_args=(*context, "--proxy-tool-parser-path", "bench.proxy_overhead:EveryReplyCalls"),
    )
    started = time.perf_counter()
    try:

        async def run() -> list[tuple[dict, list[dict]]]:
            async with httpx.AsyncClient(timeout=1800) as http:
                return await asyncio.gather(*(episode(http, procs["proxy"].url, i, args) for i in range(args.episodes)))

        results = asyncio.run(run())
        recorded_s = time.perf_counter() - started
        memory = {name: vm_hwm_mb(proc.popen.pid) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.terminate()
    samples = [sample for sample, _ in results]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(samples, file)
        file.flush()
        done = subprocess.run(
            [sys.executable, __file__, "--model", str(model), "--train-child", file.name],
            capture_output=True,
            text=True,
        )
    if done.returncode:
        raise SystemExit(f"the trainer failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    trainer = json.loads(done.stdout.strip().splitlines()[-1])
    # what each later turn resent (the previous turn's prompt and reply) that the engine's cache served
    later = [t["cached_tokens"] / before["total_tokens"] for _, turns in results for before, t in zip(turns, turns[1:])]
    print(
        json.dumps(
            {
                "model": str(model),
                "episodes": args.episodes,
                "target_length": args.length,
                "tokens": [len(s["tokens"]) for s in samples],
                "turns": [len(t) for _, t in results],
                "sampled_tokens": [sum(s["loss_mask"]) for s in samples],
                "loss_mask_exact": all(map(mask_is_exact, samples)),
                "recorded_s": round(recorded_s, 1),
                "turn_latency_s_first_last": [[t[0]["latency_s"], t[-1]["latency_s"]] for _, t in results],
                "cached_share_of_history_mean": round(statistics.mean(later), 4),
                "cached_share_of_history_min": round(min(later), 4),
                "peak_rss_mb": {**memory, "trainer": trainer["peak_rss_mb"]},
                "train_step_s": trainer["step_s"],
                "train_metrics": trainer["metrics"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
