"""Training throughput of the Megatron trainer vs a plain ``transformers`` + AdamW step. Prints JSON.

Both train the ``small`` tiny-model preset (~14M parameters) on the same batch: 16 samples of
192-256 tokens (64-token prompts), a GRPO-style objective on the response tokens. The baseline
is what one writes by hand with ``transformers``: one padded forward of the batch, log-softmax of
the response tokens, ``-(advantage * logp)`` averaged over response tokens, backward,
``torch.optim.AdamW`` step. Ours is ``Trainer.train`` (packed micro-batches of
``--max-tokens-per-gpu`` 4096, PPO-clip loss with entropy metrics, gradient sync, clipping, step)
on one CPU process. Rounds alternate the two and medians are reported; the ratio is ours /
baseline in training tokens per second (target >= 0.8 on CPU).

    python bench/train_step.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.config import TinyModelConfig, TrainConfig  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402
from inverted.types import Sample  # noqa: E402


def make_batch(seed: int = 0, count: int = 16) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(torch.randint(192, 257, (1,), generator=g))
        tokens = torch.randint(3, 1200, (length,), generator=g).tolist()
        n = length - 64
        samples.append(Sample(group_index=i // 4, index=i, tokens=tokens, response_length=n, loss_mask=[1] * n,
                              rollout_log_probs=[-1.0] * n, weight_versions=["0"] * n, reward=float(i % 2),
                              status=Sample.Status.COMPLETED))
    return samples


def baseline_step(model, optimizer, samples: list[Sample]) -> None:
    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    response = torch.zeros(len(samples), width - 1)
    for row, s in enumerate(samples):
        ids[row, :len(s.tokens)] = torch.tensor(s.tokens)
        attention[row, :len(s.tokens)] = 1
        response[row, s.prompt_length - 1:len(s.tokens) - 1] = 1
    advantages = torch.tensor([s.reward - 0.5 for s in samples])[:, None]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss = -(advantages * logp * response).sum() / response.sum()
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import transformers

    from torch.distributed.elastic.utils.distributed import get_free_port

    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(TinyModelConfig(out=f"{tmp}/small", arch="qwen2", preset="small"))
        samples = make_batch()
        tokens = sum(len(s.tokens) for s in samples)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)

        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
        cfg = TrainConfig(hf_checkpoint=str(path), lr=1e-6)
        init_parallel(cfg)
        trainer = Trainer(cfg)
        baseline_step(hf, hf_opt, samples)  # warm-up both
        trainer.train(samples)
        ours, base = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            baseline_step(hf, hf_opt, samples)
            base.append(tokens / (time.perf_counter() - start))
            start = time.perf_counter()
            trainer.train(samples)
            ours.append(tokens / (time.perf_counter() - start))
        shutdown_parallel()
    result = {
        "model": "small (qwen2, ~14M params)", "batch_tokens": tokens, "rounds": args.rounds, "threads": torch.get_num_threads(),
        "baseline_transformers_tokens_per_s": round(statistics.median(base), 1),
        "megatron_trainer_tokens_per_s": round(statistics.median(ours), 1),
        "ratio": round(statistics.median(ours) / statistics.median(base), 3), "target_ratio": 0.8,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
