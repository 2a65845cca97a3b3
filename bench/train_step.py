"""Training throughput of the Megatron trainer vs a plain ``transformers`` + AdamW step. Prints JSON.

Both train the same model on the same batch with a GRPO-style objective on the response tokens
(64-token prompts). The baseline is what one writes by hand with ``transformers``: one padded
forward of the batch, log-softmax of the response tokens, ``-(advantage * logp)`` averaged over
response tokens, backward, ``torch.optim.AdamW`` step. Ours is ``Trainer.train`` (packed
micro-batches of ``--max-tokens-per-gpu``, PPO-clip loss with entropy metrics, gradient sync,
clipping, step). Rounds alternate the two and medians are reported; the ratio is ours / baseline
in training tokens per second.

- CPU (default): the ``small`` preset (~14M parameters), 16 samples of 192-256 tokens, fp32, one
  process; target ratio >= 0.8.
- ``--model DIR`` trains that checkpoint instead (e.g. ``models/smollm2-135m``, the main job's);
  ``--shape grpo`` is the main job's batch: 4 groups of 16 samples that share a 48-token prompt,
  with 4-16-token responses (the trainer lays each prompt out once, ``train/packing.py``; the
  baseline pads every sample whole, as one would by hand).
- ``--device cuda``: the ``base`` preset (~0.5B), 16 samples of 768-1024 tokens in bf16 (ours:
  Megatron's bf16 model with fp32 main weights and its optimizer; the baseline: fp32 weights
  under ``torch.autocast``). Also reports model FLOPs utilisation: 6 x matmul parameters per
  token plus causal attention, against the GPU's dense bf16 peak.

- ``--lora-rank R``: the trainer with a rank-``R`` LoRA adapter on every linear module against
  the same trainer fine-tuning every weight, on the same model and batch (target ratio >= 1.3 on
  CPU). Memory of each, in a process of its own: its training state (weights, gradient buffers,
  optimizer state, counted tensor by tensor) and the process's peak resident memory (``VmHWM``)
  over building the trainer and three steps.

    python bench/train_step.py [--rounds 5]
    python bench/train_step.py --model models/smollm2-135m --shape grpo [--rounds 3]
    python bench/train_step.py --model models/smollm2-135m --shape grpo --lora-rank 16
    python bench/train_step.py --device cuda

- ``--arch qwen3_moe`` (or ``qwen2_moe``): the generated model is that Mixture-of-Experts
  architecture (8 experts, 2 per token), against ``transformers``' own MoE. With ``--ep N``: the
  trainer with its experts shared out over N processes (expert parallelism, all-to-all over gloo,
  each process a 1/N share of the threads) against the same trainer in one process with every
  thread (EP=1), on the same batch; each run in processes of its own.

    python bench/train_step.py --arch qwen3_moe --ep 2 [--rounds 3]

- ``--memory``: the trainer's peak resident memory (``VmHWM``) and step time against the hand-written
  ``transformers`` step's, and against the same trainer with the whole micro-batch's logits and no
  recomputation (``--logprob-chunk-size 0 --recompute-granularity none``: the trainer before #60), each
  in a process of its own (building it and ``--rounds`` steps; the step time is the median after the
  first). The hand-written step goes over padded micro-batches of the trainer's token budget,
  accumulating gradients: the whole batch at once does not fit in 24 GiB. ``--shape agent`` is ``make
  agent``'s batch: 8 groups of 8 two-turn episodes of about 340 tokens (a ~250-token prompt of
  instructions and tools shared by each group, a call, a tool result masked out, an answer); ``--shape
  context`` one Sample of the model's whole context (8,192 tokens for SmolLM2), half of it response.

    python bench/train_step.py --model models/smollm2-135m --shape agent --memory [--rounds 3]
    python bench/train_step.py --model models/smollm2-135m --shape context --memory --rounds 2

- ``--details-cost``: what ``--save-train-details`` costs a step (the trainer's log-probs and
  advantages of every Sample into ``train_details.db``): one trainer, its steps alternately with
  and without it, on the same batch.

    python bench/train_step.py --model models/smollm2-135m --shape grpo --details-cost [--rounds 5]

- ``--restart-save-cost``: what keeping the trainer's state for a restart (``--restart-save-interval``,
  every step by default) costs: the write of the model and optimizer, against a step on the same
  batch. The job writes it in the background while the next rollout runs, so a step waits for
  it only where the rollout is shorter.

    python bench/train_step.py --model models/smollm2-135m --shape agent --restart-save-cost [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.config import TinyModelConfig, from_flags  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402
from inverted.train.config import TrainConfig
from inverted.types import Sample  # noqa: E402


def make_batch(seed: int = 0, count: int = 16, lengths: tuple[int, int] = (192, 256)) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(count):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        tokens = torch.randint(3, 1200, (length,), generator=g).tolist()
        n = length - 64
        samples.append(
            Sample(
                group_index=i // 4,
                index=i,
                tokens=tokens,
                response_length=n,
                loss_mask=[1] * n,
                rollout_log_probs=[-1.0] * n,
                weight_versions=["0"] * n,
                reward=float(i % 2),
                status=Sample.Status.COMPLETED,
            )
        )
    return samples


def make_grpo_batch(
    seed: int = 0, groups: int = 4, per_group: int = 16, prompt: int = 48, responses: tuple[int, int] = (4, 16)
) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(groups):
        shared = torch.randint(3, 1200, (prompt,), generator=g).tolist()
        for i in range(per_group):
            n = int(torch.randint(responses[0], responses[1] + 1, (1,), generator=g))
            samples.append(
                Sample(
                    group_index=group,
                    index=group * per_group + i,
                    tokens=shared + torch.randint(3, 1200, (n,), generator=g).tolist(),
                    response_length=n,
                    loss_mask=[1] * n,
                    rollout_log_probs=[-1.0] * n,
                    weight_versions=["0"] * n,
                    reward=float(i % 2),
                    status=Sample.Status.COMPLETED,
                )
            )
    return samples


def make_agent_batch(seed: int = 0, groups: int = 8, per_group: int = 8, prompt: int = 250) -> list[Sample]:
    """``make agent``'s shape: per episode a call (mask 1), the tool's result (mask 0), an answer (mask 1)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    samples = []
    for group in range(groups):
        shared = torch.randint(3, 1200, (prompt + draw(-20, 20),), generator=g).tolist()
        for i in range(per_group):
            call, result, answer = draw(16, 28), draw(10, 16), draw(40, 80)
            n = call + result + answer
            mask = [1] * call + [0] * result + [1] * answer
            samples.append(
                Sample(
                    group_index=group,
                    index=group * per_group + i,
                    tokens=shared + torch.randint(3, 1200, (n,), generator=g).tolist(),
                    response_length=n,
                    loss_mask=mask,
                    rollout_log_probs=[-1.0 * m for m in mask],
                    weight_versions=["0"] * n,
                    reward=float(i % 2),
                    status=Sample.Status.COMPLETED,
                )
            )
    return samples


def make_context_batch(path: Path, seed: int = 0) -> list[Sample]:
    """One Sample of the model's whole context, its second half the response."""
    length = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    tokens = torch.randint(3, 1200, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    n = length // 2
    return [
        Sample(
            group_index=0,
            index=0,
            tokens=tokens,
            response_length=n,
            loss_mask=[1] * n,
            rollout_log_probs=[-1.0] * n,
            weight_versions=["0"] * n,
            reward=1.0,
            status=Sample.Status.COMPLETED,
        )
    ]


def baseline_step(model, optimizer, samples: list[Sample], budget: int | None = None) -> None:
    """One step as one writes it by hand; with a token ``budget``, over padded micro-batches of at most
    that many tokens, gradients accumulated (what it takes to fit a large batch)."""
    device = model.device
    chunks, chunk = [], []
    for s in sorted(samples, key=lambda s: len(s.tokens)):
        if chunk and budget and (len(chunk) + 1) * len(s.tokens) > budget:
            chunks.append(chunk)
            chunk = []
        chunk.append(s)
    chunks.append(chunk)
    total = sum(len(s.loss_mask) for s in samples)
    optimizer.zero_grad()
    for chunk in chunks:
        width = max(len(s.tokens) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        response = torch.zeros(len(chunk), width - 1)
        for row, s in enumerate(chunk):
            ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
            attention[row, : len(s.tokens)] = 1
            response[row, s.prompt_length - 1 : len(s.tokens) - 1] = 1
        ids, attention, response = ids.to(device), attention.to(device), response.to(device)
        advantages = torch.tensor([s.reward - 0.5 for s in chunk], device=device)[:, None]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(advantages * logp * response).sum() / total).backward()
        del logits, logp
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}  # dense, per vendor data sheets


def model_flops(path: Path, samples: list[Sample]) -> float:
    """Training FLOPs of one pass over ``samples``: 3 x (2 x matmul params per token + causal attention)."""
    config = json.loads((path / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * config["intermediate_size"]
    matmul_params = layers * per_layer + hidden * config["vocab_size"]  # the output layer too
    forward = 0.0
    for s in samples:
        n = len(s.tokens)
        forward += 2 * matmul_params * n + 4 * layers * heads * head_dim * n * (n + 1) / 2
    return 3 * forward


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def state_mb(trainer) -> dict[str, float]:
    """MB of a (CPU) trainer's training state: weights, gradient buffers, optimizer state."""
    params = list(trainer.model.parameters())
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**20  # noqa: E731
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    moments = [
        t
        for state in trainer.optimizer.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim()
    ]
    return {
        "weights": round(size(params), 1),
        "grads": round(size(grads), 1),
        "optimizer": round(size(moments), 1),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
    }


def peak_rss_mb() -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def memory_of(args, path: Path, samples: list[Sample], budget: int) -> dict:
    """This process's peak resident memory over building one trainer (LoRA or not), or the hand-written
    ``transformers`` step, and its steps (three, or ``--rounds`` with ``--memory``); the median step
    time after the first."""
    steps = args.rounds if args.memory else 3
    if args.memory_of == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        seconds = [timed(lambda: baseline_step(model, optimizer, samples, budget), "cpu") for _ in range(steps)]
        return {"peak_rss_mb": round(peak_rss_mb(), 1), "step_s": round(statistics.median(seconds[1:] or seconds), 3)}
    from inverted.train.trainer import Trainer

    # "logits": the trainer as it was before #60, with the whole micro-batch's logits and no recomputation
    before = dict(logprob_chunk_size=0, recompute_granularity="none") if args.memory_of == "logits" else {}
    trainer = Trainer(
        from_flags(
            TrainConfig,
            hf_checkpoint=str(path),
            lr=1e-6,
            max_tokens_per_gpu=budget,
            lora_rank=args.lora_rank if args.memory_of == "lora" else 0,
            **before,
        )
    )
    seconds = [timed(lambda: trainer.train(samples), "cpu") for _ in range(steps)]
    return {
        "state_mb": state_mb(trainer),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "step_s": round(statistics.median(seconds[1:] or seconds), 3),
    }


def child(mode: str) -> dict:
    """``memory_of`` in a process of its own (this script, ``--memory-of mode``); one the kernel killed
    for memory says so, with the machine's."""
    done = subprocess.run(
        [sys.executable, __file__, *sys.argv[1:], "--memory-of", mode], capture_output=True, text=True
    )
    if done.returncode == -9:
        total = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
        return {"peak_rss_mb": None, "killed": f"out of memory (SIGKILL; the machine's {total.split()[1]} kB)"}
    if done.returncode:
        raise RuntimeError(f"--memory-of {mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def memory_vs_transformers(args, path: Path, samples: list[Sample]) -> dict:
    """The trainer's peak memory and step time against the hand-written ``transformers`` step's, and
    against the trainer with whole logits and no recomputation (``--logprob-chunk-size 0
    --recompute-granularity none``, as it was before #60)."""
    ours, logits, base = child("full"), child("logits"), child("transformers")

    def ratios(other: dict) -> dict:
        if not (ours["peak_rss_mb"] and other["peak_rss_mb"]):
            return {}
        return {
            "peak_rss_ratio": round(ours["peak_rss_mb"] / other["peak_rss_mb"], 3),
            "step_time_ratio": round(ours["step_s"] / other["step_s"], 3),
        }

    return {
        "model": str(path),
        "shape": args.shape,
        "samples": len(samples),
        "batch_tokens": sum(len(s.tokens) for s in samples),
        "trained_tokens": sum(sum(s.loss_mask) for s in samples),
        "steps": args.rounds,
        "threads": torch.get_num_threads(),
        "trainer": ours,
        "trainer_whole_logits": logits,
        "transformers": base,
        "vs_whole_logits": ratios(logits),
        "vs_transformers": ratios(base),
    }


def lora_vs_full(args, path: Path, samples: list[Sample], budget: int) -> dict:
    """Our trainer with a LoRA adapter against our trainer fine-tuning every weight, rounds alternating."""
    from inverted.train.trainer import Trainer

    tokens = sum(len(s.tokens) for s in samples)
    full = Trainer(from_flags(TrainConfig, hf_checkpoint=str(path), lr=1e-6, max_tokens_per_gpu=budget))
    lora = Trainer(
        from_flags(TrainConfig, hf_checkpoint=str(path), lr=1e-6, max_tokens_per_gpu=budget, lora_rank=args.lora_rank)
    )
    full.train(samples), lora.train(samples)  # warm-up
    speed: dict[str, list[float]] = {"full": [], "lora": []}
    for _ in range(args.rounds):
        for name, trainer in (("full", full), ("lora", lora)):
            speed[name].append(tokens / timed(lambda: trainer.train(samples), "cpu"))
    full_tps, lora_tps = statistics.median(speed["full"]), statistics.median(speed["lora"])
    return {
        "model": str(path),
        "shape": args.shape,
        "batch_tokens": tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "lora_rank": args.lora_rank,
        "full_tokens_per_s": round(full_tps, 1),
        "lora_tokens_per_s": round(lora_tps, 1),
        "ratio": round(lora_tps / full_tps, 3),
        "target_ratio": 1.3,
        "memory": {mode: child(mode) for mode in ("full", "lora")},
    }


def ep_rank(cfg: TrainConfig, samples: list[Sample], rounds: int, threads: int, out: str) -> None:
    """One rank of an expert-parallel run: a warm-up step, then ``rounds`` timed ones (rank 0 writes them)."""
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    torch.set_num_threads(threads)
    init_parallel(cfg.parallel, cfg.seed)
    trainer = Trainer(cfg)
    trainer.train(samples)
    seconds = [timed(lambda: trainer.train(samples), "cpu") for _ in range(rounds)]
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(seconds))
    shutdown_parallel()


def ep_vs_ep1(args, path: Path, samples: list[Sample], budget: int) -> dict:
    """The trainer at ``--ep N`` (N processes) against EP=1 (one process, every thread), each in new processes."""
    import multiprocessing

    from inverted.train.parallel import spawn

    tokens, cores = sum(len(s.tokens) for s in samples), os.cpu_count() or 1
    speed = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, args.ep):
            cfg = from_flags(
                TrainConfig,
                hf_checkpoint=str(path),
                lr=1e-6,
                max_tokens_per_gpu=budget,
                expert_model_parallel_size=ep,
                actor_num_gpus_per_node=ep,
            )
            out = f"{tmp}/ep{ep}.json"
            # EP=1 in a process of its own too, so neither run inherits the other's state
            runner = multiprocessing.get_context("spawn").Process(
                target=spawn, args=(ep_rank, ep, cfg, samples, args.rounds, max(1, cores // ep), out)
            )
            runner.start()
            runner.join()
            speed[ep] = tokens / statistics.median(json.loads(Path(out).read_text()))
    return {
        "model": f"{args.model or args.arch} (small preset)" if not args.model else args.model,
        "shape": args.shape,
        "batch_tokens": tokens,
        "rounds": args.rounds,
        "cores": cores,
        "ep1_tokens_per_s": round(speed[1], 1),
        f"ep{args.ep}_tokens_per_s": round(speed[args.ep], 1),
        "ratio": round(speed[args.ep] / speed[1], 3),
    }


def details_cost(args, path: Path, samples: list[Sample], budget: int) -> dict:
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = from_flags(TrainConfig, hf_checkpoint=str(path), lr=1e-6, max_tokens_per_gpu=budget, output_dir=out)
        init_parallel(cfg.parallel, cfg.seed)
        trainer = Trainer(cfg)
        trainer.train(samples)  # warm-up, and the file's creation
        timings: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for flag in (True, False):
                trainer.cfg.save_train_details = flag
                timings[flag].append(timed(lambda: trainer.train(samples), args.device))
        shutdown_parallel()
    with_s, without_s = statistics.median(timings[True]), statistics.median(timings[False])
    return {
        "samples": len(samples),
        "response_tokens": sum(s.response_length for s in samples),
        "rounds": args.rounds,
        "step_with_details_s": round(with_s, 4),
        "step_without_s": round(without_s, 4),
        "cost": round(with_s / without_s - 1, 4),
        "target": "measured",
    }


def restart_save_cost(args, path: Path, samples: list[Sample], budget: int) -> dict:
    from inverted.train.checkpoint import save_checkpoint
    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = from_flags(TrainConfig, hf_checkpoint=str(path), lr=1e-6, max_tokens_per_gpu=budget, output_dir=out)
        init_parallel(cfg.parallel, cfg.seed)
        trainer = Trainer(cfg)
        trainer.train(samples)  # warm-up: the optimizer's state exists after a step
        steps, saves = [], []
        for _ in range(args.rounds):
            steps.append(timed(lambda: trainer.train(samples), args.device))
            saves.append(timed(lambda: save_checkpoint(trainer, out), args.device))
        size = sum(f.stat().st_size for f in Path(out).glob("iter_*/*"))
        shutdown_parallel()
    step_s, save_s = statistics.median(steps), statistics.median(saves)
    return {
        "samples": len(samples),
        "rounds": args.rounds,
        "step_s": round(step_s, 3),
        "save_s": round(save_s, 3),
        "saved_mb": round(size / args.rounds / 2**20),
        "save_over_step": round(save_s / step_s, 4),
        "target": "measured (written while the next rollout runs)",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: a generated preset)")
    parser.add_argument(
        "--shape",
        choices=["long", "grpo", "agent", "context"],
        default="long",
        help="long: 16 samples of 192-256 tokens; grpo: groups sharing a prompt, short responses; "
        "agent: make agent's two-turn episodes; context: one Sample of the model's whole context",
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="compare LoRA of this rank with full fine-tuning")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="the trainer's peak resident memory and step time against the transformers step's",
    )
    parser.add_argument(
        "--memory-of", choices=["full", "lora", "logits", "transformers"], help=argparse.SUPPRESS
    )  # a child of --lora-rank or --memory
    parser.add_argument(
        "--arch",
        default="qwen2",
        choices=["qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe"],
        help="architecture of the generated model",
    )
    parser.add_argument("--ep", type=int, default=0, help="compare expert parallelism of this size with EP=1 (MoE)")
    parser.add_argument(
        "--details-cost", action="store_true", help="a step with --save-train-details against one without"
    )
    parser.add_argument(
        "--restart-save-cost", action="store_true", help="the trainer's state saved for a restart, against a step"
    )
    args = parser.parse_args()
    import transformers

    from inverted.train.parallel import init_parallel, shutdown_parallel
    from inverted.train.trainer import Trainer

    cuda = args.device == "cuda"
    preset, lengths, budget = ("base", (768, 1024), 16384) if cuda else ("small", (192, 256), 4096)
    with tempfile.TemporaryDirectory() as tmp:
        path = (
            Path(args.model)
            if args.model
            else make_tiny_model(TinyModelConfig(out=f"{tmp}/{preset}", arch=args.arch, preset=preset))
        )
        samples = {"grpo": make_grpo_batch, "agent": make_agent_batch, "context": lambda: make_context_batch(path)}.get(
            args.shape, lambda: make_batch(lengths=lengths)
        )()
        tokens = sum(len(s.tokens) for s in samples)
        if args.ep:
            print(json.dumps(ep_vs_ep1(args, path, samples, budget), indent=2))
            return
        if args.details_cost or args.restart_save_cost:
            os.environ.update(RANK="0", WORLD_SIZE="1")
            measure = details_cost if args.details_cost else restart_save_cost
            print(json.dumps(measure(args, path, samples, budget), indent=2))
            return
        if args.memory and not args.memory_of:
            print(json.dumps(memory_vs_transformers(args, path, samples), indent=2))
            return
        if args.lora_rank or args.memory_of:
            os.environ.update(RANK="0", WORLD_SIZE="1")
            cfg = from_flags(TrainConfig, hf_checkpoint=str(path))
            init_parallel(cfg.parallel, cfg.seed)
            measure = memory_of if args.memory_of else lora_vs_full
            print(json.dumps(measure(args, path, samples, budget), indent=2))
            shutdown_parallel()
            return
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-6)

        os.environ.update(RANK="0", WORLD_SIZE="1")
        cfg = from_flags(TrainConfig, hf_checkpoint=str(path), lr=1e-6, bf16=cuda, max_tokens_per_gpu=budget)
        init_parallel(cfg.parallel, cfg.seed)
        trainer = Trainer(cfg)
        baseline_step(hf, hf_opt, samples)  # warm-up both
        trainer.train(samples)
        ours, base = [], []
        for _ in range(args.rounds):
            base.append(tokens / timed(lambda: baseline_step(hf, hf_opt, samples), args.device))
            ours.append(tokens / timed(lambda: trainer.train(samples), args.device))
        shutdown_parallel()
        flops_per_token = model_flops(path, samples) / tokens
    params = sum(p.numel() for p in hf.parameters())
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": "bfloat16" if cuda else "float32",
        "model": f"{args.model or f'{preset} {args.arch}'} ({params / 1e6:.1f}M params)",
        "shape": args.shape,
        "batch_tokens": tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "baseline_transformers_tokens_per_s": round(statistics.median(base), 1),
        "megatron_trainer_tokens_per_s": round(statistics.median(ours), 1),
        "ratio": round(statistics.median(ours) / statistics.median(base), 3),
    }
    if cuda:
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in result["device"]), None)
        result |= {
            "flops_per_token": round(flops_per_token),
            "peak_bf16_tflops": peak,
            "megatron_trainer_mfu": round(statistics.median(ours) * flops_per_token / (peak * 1e12), 3)
            if peak
            else None,
            "baseline_transformers_mfu": round(statistics.median(base) * flops_per_token / (peak * 1e12), 3)
            if peak
            else None,
        }
    else:
        result["target_ratio"] = 0.8
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
