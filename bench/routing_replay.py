"""The train/rollout log-prob mismatch of a Mixture-of-Experts policy, with and without routing replay
(R3). Prints JSON.

An embedded engine samples GRPO groups from a MoE checkpoint with ``return_routed_experts``; the
trainer (fp32, the same weights) takes one step on them three ways: plain, and with
``--use-rollout-routing-replay``, at learning rate 0 so that only the forward differs. The figure
is the trainer's ``train/train_rollout_logprob_abs_diff`` (mean |trainer - engine| over sampled
tokens). Two sources of routing disagreement:

- ``bf16``: the engine in bfloat16, the trainer in fp32 (a real deployment's gap);
- ``perturbed``: the engine in fp32 on routers with noise of ``--noise`` x their spread (routing
  disagreement alone, with the rest of the model exact).

``routed_differently``: the share of (token, layer) routes where the engine's experts differ from
those the trainer's routers pick, read from a recording forward. Replay fixes the ids; the gate
weights stay the trainer's (recomputed over those ids), so what remains with R3 is the weight gap.

    python bench/routing_replay.py [--arch qwen3_moe] [--preset small] [--groups 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.config import TinyModelConfig, from_flags  # noqa: E402
from inverted.hf_checkpoint import ModelSpec  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.tiny_model import make_tiny_model, perturb_routers  # noqa: E402
from inverted.train.config import TrainConfig
from inverted.train.routing_replay import decode_routes  # noqa: E402
from inverted.types import Sample  # noqa: E402

GAP = "train/train_rollout_logprob_abs_diff"


def rollout(model: Path, dtype: str, groups: int, per_group: int, log: Path) -> list[Sample]:
    port = free_port()
    engine = ManagedProcess.spawn(
        "bench-engine",
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "serve-engine",
            "--model",
            str(model),
            "--port",
            str(port),
            "--dtype",
            dtype,
            "--enable-return-routed-experts",
        ],
        log,
        f"http://127.0.0.1:{port}",
    )
    try:
        engine.wait_healthy(120)
        g = torch.Generator().manual_seed(1)
        samples = []
        for group in range(groups):
            prompt = torch.randint(3, 1200, (32,), generator=g).tolist()
            outs = httpx.post(
                engine.url + "/generate",
                timeout=600,
                json={
                    "input_ids": [prompt] * per_group,
                    "return_logprob": True,
                    "return_routed_experts": True,
                    "sampling_params": {"max_new_tokens": 32, "ignore_eos": True, "sampling_seed": group},
                },
            ).json()
            for i, out in enumerate(outs):
                n = len(out["output_ids"])
                samples.append(
                    Sample(
                        group_index=group,
                        index=group * per_group + i,
                        tokens=prompt + out["output_ids"],
                        response_length=n,
                        loss_mask=[1] * n,
                        rollout_log_probs=[t[0] for t in out["meta_info"]["output_token_logprobs"]],
                        weight_versions=["0"] * n,
                        reward=float(i % 2),
                        status=Sample.Status.COMPLETED,
                        rollout_routed_experts=out["meta_info"]["routed_experts"],
                    )
                )
        return samples
    finally:
        engine.terminate()


def mismatch(path: Path, samples: list[Sample]) -> dict:
    """The trainer's gap without and with R3, and how often its own routing differs from the engine's."""
    from inverted.train.trainer import Trainer

    out = {}
    for name, replay in (("plain", False), ("r3", True)):
        trainer = Trainer(
            from_flags(
                TrainConfig,
                hf_checkpoint=str(path),
                lr=0.0,
                max_tokens_per_gpu=1 << 16,
                use_rollout_routing_replay=replay,
            )
        )
        out[name] = trainer.train(samples)[GAP]
    # the trainer's own routing, recorded over the same packed batches (R2's recording forward)
    trainer = Trainer(
        from_flags(TrainConfig, hf_checkpoint=str(path), use_routing_replay=True, max_tokens_per_gpu=1 << 16)
    )
    spec, differ, total = ModelSpec.from_checkpoint(path), 0, 0
    for mb in (mb for step in trainer._plan(samples) for mb in step.micro_batches):
        trainer._no_grad_logprobs(trainer.model, [mb], "record")
        mine = trainer.replay.recorded[id(mb)]
        for index, positions in zip(mb.indices, mb.sequence_positions()):
            engine = decode_routes(samples[index], spec)
            for layer, chosen in mine.items():
                ours = chosen.cpu()[positions[:-1]].sort(-1).values
                differ += int((ours != engine[:, layer].sort(-1).values).any(-1).sum())
                total += len(positions) - 1
    trainer.replay.reset()
    return {
        "plain_logprob_abs_diff": round(out["plain"], 5),
        "r3_logprob_abs_diff": round(out["r3"], 5),
        "r3_over_plain": round(out["r3"] / out["plain"], 3),
        "routed_differently": round(differ / total, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "qwen2_moe"])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.03)
    args = parser.parse_args()

    import os

    from inverted.train.parallel import init_parallel, shutdown_parallel

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(TinyModelConfig(out=f"{tmp}/model", arch=args.arch, preset=args.preset))
        sources = {
            "bf16": (path, "bfloat16"),
            "perturbed": (perturb_routers(path, Path(tmp) / "noisy", args.noise), "float32"),
        }
        rollouts = {
            name: rollout(model, dtype, args.groups, args.per_group, Path(tmp) / f"{name}.log")
            for name, (model, dtype) in sources.items()
        }
        os.environ.update(RANK="0", WORLD_SIZE="1")
        cfg = from_flags(TrainConfig, hf_checkpoint=str(path))
        init_parallel(cfg.parallel, cfg.seed)
        result = {
            "model": f"{args.preset} {args.arch}",
            "samples": args.groups * args.per_group,
            "noise": args.noise,
            **{name: mismatch(path, samples) for name, samples in rollouts.items()},
        }
        shutdown_parallel()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
