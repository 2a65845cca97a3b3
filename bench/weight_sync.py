"""Weight-sync bandwidth per transport against a raw copy of the same bytes, in one run. Prints JSON.

For each model (the ``small`` preset, ~14M parameters, and the ``base`` preset, ~0.5B, both
fp32 on CPU) one embedded engine is started and the model's weights are pushed into it with
``WeightSync`` (buckets of ``--buffer-size`` bytes, pause mode ``in_place``):

- **tensor**: pack into a shared-memory bucket, the engine copies it into its parameters.
  Baseline: one ``memcpy`` (``Tensor.copy_``) of the same bytes. The floor is two copies, so the
  ratio's ceiling is 0.5; the target is >= 0.4. ``two_copies``: those two copies alone, timed in
  the same run in this process (the weights into shared-memory buckets, then out of them into
  tensors shaped as the parameters; no HTTP, no second process, no layout work): ``ceiling_ratio``
  is the best ratio any pack-then-copy transport can reach on this machine, ``of_floor`` how much
  of it ours reaches.
- **distributed**: one gloo broadcast per bucket to the engine, which copies it in. Baseline: raw
  gloo broadcasts of the same bytes to a second process, acknowledged at the end. Target >= 0.5.
- **repeated_call_ms** (under ``tensor``, CPU): one ``/update_weights_from_tensor`` call whose payload is
  sent again and again in one session: what the engine spends per call, its copy included.
- **payload_ms**: building the tensor payloads of one update, each bucket dict pickled whole
  (``serialize``) against ``bucket_payload``, which reuses the pickled metadata of an unchanged layout.

With ``--device cuda`` (one GPU) the engine runs on the GPU in bfloat16 and only the tensor
transport is measured (CUDA-IPC handles; NCCL cannot put two ranks on one GPU), against one
device-to-device copy of the same bytes; target >= 0.3. Use ``--presets large`` (~1.3B) there.

Effective GB/s = bytes / the update's bucket phase (pack + send + the engine's copy, overlapped);
``total_s`` is the whole update (pause, session, version, flush, continue included); ``phases_s``
each phase on its own; ``engine_s`` the engine's own share of ``send`` from its ``/metrics``
(receiving broadcasts, decoding payloads, copying into the parameters), per update. Every figure
is the median of ``--rounds`` updates after one warm-up (``engine_s``: the mean). Each update is
timed right beside its baselines, and each ratio is the median of the rounds' own ratios.

With ``--lora`` (and ``--model``, e.g. SmolLM2) the engine serves LoRA and two updates of the
same model are timed side by side, each whole (``total_s``: pause to continue): the full weights
over the tensor transport, and a rank-``--lora-rank`` adapter on every linear module, which a LoRA
run sends instead (``/load_lora_adapter_from_tensors``, unloading the old one first). Target: the
adapter's update takes <= 0.05x the full one's time. ``floor_ratio``: the least any adapter update
can take here, over the full update's time: the phases every update pays whatever it moves (HTTP
round trips: connect, pause, version, continue), the adapter's own two round trips (unload, load)
and two copies of its bytes at memcpy speed.

    python bench/weight_sync.py [--presets small base] [--rounds 3] [--buffer-size 536870912]
    python bench/weight_sync.py --device cuda --presets large
    python bench/weight_sync.py --lora --model models/smollm2-135m [--lora-rank 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.cli import spin_briefly  # noqa: E402

# This process is the sender, standing in for the trainer: it runs torch as `inverted train` runs
# it. With libgomp's default ~3 ms of spinning after each region, the pack's workers kept a core
# busy while the engine copied (measured, small model, 2 cores: send 6.6-20.7 ms, against 6.2-6.5).
spin_briefly()

import torch  # noqa: E402

from inverted.config import TinyModelConfig  # noqa: E402
from inverted.hf_checkpoint import ModelSpec, checkpoint_tensors  # noqa: E402
from inverted.peft_adapter import LoRAConfig, module_shapes, tensor_name  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.rollout.sglang_client import SGLangClient  # noqa: E402
from inverted.tiny_model import make_tiny_model  # noqa: E402
from inverted.train.weight_sync import BucketPacker, DistributedTransport, TensorTransport, WeightSync  # noqa: E402
from inverted.weight_wire import bucket_payload, copy_all, join_update_group, serialize, unflatten  # noqa: E402

RUNS = Path("runs/bench")


def model_dir(preset: str) -> Path:
    out = RUNS / "models" / f"qwen2-{preset}"
    if not (out / "config.json").exists():
        make_tiny_model(TinyModelConfig(out=str(out), arch="qwen2", preset=preset, seed=0))
    return out


def start_engine(path: Path, device: str, *extra: str) -> ManagedProcess:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "inverted.cli",
        "serve-engine",
        "--model",
        str(path),
        "--port",
        str(port),
        "--max-running-requests",
        "4",
        "--context-length",
        "256",
        "--log-level",
        "warning",
        "--device",
        device,
        "--dtype",
        "float32" if device == "cpu" else "bfloat16",
        *extra,
    ]
    proc = ManagedProcess.spawn("bench-engine", argv, RUNS / "weight_sync_engine.log", f"http://127.0.0.1:{port}")
    proc.wait_healthy(600)
    return proc


def memcpy_timer(total: int, chunk: int, device: str = "cpu") -> Callable[[], float]:
    """A timer of one copy of ``total`` bytes on ``device``, in chunks of the bucket size (the memory a
    bucket touches). Its buffers are made once and touched first, as ours are after the warm-up
    update: page faults are not copies. (Fresh 52 MB buffers at every round, freed after it, made
    the engine's next copy into its parameters take 13 ms instead of 5 on this VM.)"""
    src = torch.empty(min(chunk, total), dtype=torch.uint8, device=device).random_()
    dst = src.clone()

    def once() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for offset in range(0, total, chunk):
            n = min(chunk, total - offset)
            dst[:n].copy_(src[:n])
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    return once


def two_copies_timer(weights: dict[str, torch.Tensor], buffer_size: int, device: str) -> Callable[[], float]:
    """A timer of the tensor transport's two copies alone: the weights into shared buckets (as ours
    are), then out of each bucket into tensors shaped as the parameters. Its buckets' files go with it."""
    transport = TensorTransport(torch.device(device))
    packer = BucketPacker(buffer_size, transport.allocate, next(iter(weights.values())).dtype)
    plans = [
        (
            [t for _, t in unflatten(b.flat, b.metadata)],
            [weights[n] for n in b.names],
            [torch.empty_like(weights[n]) for n in b.names],
        )
        for b in packer.pack(weights.items())
    ]

    def once() -> float:
        started = time.perf_counter()
        for views, sources, params in plans:
            copy_all(views, sources)
            copy_all(params, views)
        return time.perf_counter() - started

    once()  # page faults are not copies
    return once


async def engine_seconds(url: str) -> dict[str, float]:
    """The engine's running totals of seconds spent receiving, decoding and copying weights."""
    async with SGLangClient(url) as client:
        samples = await client.metrics()
    return {part: samples[f"inverted:weight_{part}_seconds_total"] for part in ("receive", "decode", "copy")}


def _broadcast_all(group, buffer: torch.Tensor, total: int, chunk: int) -> None:
    """``total`` bytes in bucket-sized broadcasts from rank 0, then rank 1's one-byte acknowledgement."""
    for offset in range(0, total, chunk):
        group.broadcast(buffer[: min(chunk, total - offset)])
    group.broadcast(torch.zeros(1, dtype=torch.uint8), src=1)


def _receiver(port: int, total: int, chunk: int, passes: int) -> None:
    group = join_update_group("127.0.0.1", port, 2, 1, timeout=600)
    buffer = torch.empty(min(chunk, total), dtype=torch.uint8)
    for _ in range(passes):
        _broadcast_all(group, buffer, total, chunk)
    group.close()


@contextmanager
def broadcast_timer(total: int, chunk: int, rounds: int) -> Iterator[Callable[[], float]]:
    """A timer of raw gloo broadcasts of ``total`` bytes to another process, until it acknowledges the
    last one. The receiver lives for a warm-up pass (page faults) and ``rounds`` timed ones: a process
    started and ended beside each update slowed that update (as fresh buffers do, see ``memcpy_timer``)."""
    port = free_port()
    child = multiprocessing.get_context("spawn").Process(target=_receiver, args=(port, total, chunk, rounds + 1))
    child.start()
    group = join_update_group("127.0.0.1", port, 2, 0, timeout=600)
    buffer = torch.empty(min(chunk, total), dtype=torch.uint8).random_()

    def once() -> float:
        started = time.perf_counter()
        _broadcast_all(group, buffer, total, chunk)
        return time.perf_counter() - started

    once()
    try:
        yield once
    finally:
        child.join(60)
        group.close()


def payload_ms(weights: dict[str, torch.Tensor], buffer_size: int, device: str, rounds: int) -> dict:
    """Milliseconds to build the tensor payloads of one update: the bucket dict pickled whole
    (``serialize``) against ``bucket_payload``, which reuses the pickle of an unchanged layout."""
    transport = TensorTransport(torch.device(device))
    buckets = list(
        BucketPacker(buffer_size, transport.allocate, next(iter(weights.values())).dtype).pack(weights.items())
    )

    def build(payload) -> float:
        started = time.perf_counter()
        for bucket in buckets:
            payload(bucket)
        return (time.perf_counter() - started) * 1e3

    whole = statistics.median(
        build(lambda b: serialize({"flattened_tensor": b.flat, "metadata": b.metadata})) for _ in range(rounds)
    )
    build(lambda b: bucket_payload(b.flat, b.metadata))  # an update's first payloads pickle their layouts
    reused = statistics.median(build(lambda b: bucket_payload(b.flat, b.metadata)) for _ in range(rounds))
    transport.release()
    return {"tensors": len(weights), "pickled_whole": whole, "reused_layout": reused, "ratio": whole / reused}


async def repeated_call_ms(
    url: str, weights: dict[str, torch.Tensor], buffer_size: int, device: str, calls: int = 200
) -> float:
    """Median ms of one ``/update_weights_from_tensor`` call whose payload (the first bucket) is sent
    again and again inside one session: the engine's per-call cost, its copy included, with no packing."""
    transport = TensorTransport(torch.device(device))
    packer = BucketPacker(buffer_size, transport.allocate, next(iter(weights.values())).dtype)
    bucket = next(iter(packer.pack(weights.items())))
    payload = bucket_payload(bucket.flat, bucket.metadata)
    seconds = []
    async with SGLangClient(url) as client:
        await client.begin_weight_update()
        try:
            for _ in range(calls + 5):  # 5 warm-up calls
                started = time.perf_counter()
                await client.update_weights_from_tensor([payload], load_format="flattened_bucket")
                seconds.append(time.perf_counter() - started)
        finally:
            await client.end_weight_update()
            transport.release()
    return statistics.median(seconds[5:]) * 1e3


def bench_model(preset: str, rounds: int, buffer_size: int, device: str) -> dict:
    path = model_dir(preset)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    weights = {name: t.to(device, dtype) for name, t in checkpoint_tensors(path).items()}
    total = sum(t.numel() * t.element_size() for t in weights.values())
    engine = start_engine(path, device)
    result: dict = {
        "params": sum(t.numel() for t in weights.values()),
        "bytes": total,
        "dtype": str(dtype),
        "payload_ms": payload_ms(weights, buffer_size, device, rounds),
    }
    transports = [("tensor", lambda: TensorTransport(torch.device(device)))]
    if device == "cpu":
        transports.append(("distributed", lambda: DistributedTransport(torch.device("cpu"), timeout=600)))
    try:
        for name, make in transports:
            sync = WeightSync(make(), [engine.url], buffer_size=buffer_size, pause_mode="in_place")
            asyncio.run(sync.update(weights.items(), "warm-up"))
            two_copies = two_copies_timer(weights, buffer_size, device) if name == "tensor" else None
            reports, baselines, floors = [], [], []
            with ExitStack() as stack:
                baseline_once = (
                    memcpy_timer(total, buffer_size, device)
                    if name == "tensor"
                    else stack.enter_context(broadcast_timer(total, buffer_size, rounds))
                )
                before = asyncio.run(engine_seconds(engine.url))
                # Each update is timed beside its baselines: this machine's memory speed drifts by as much
                # as half within a minute, and the drift cancels in each round's ratio.
                for i in range(rounds):
                    reports.append(asyncio.run(sync.update(weights.items(), str(i))))
                    baselines.append(baseline_once())
                    if two_copies is not None:
                        floors.append(two_copies())
                after = asyncio.run(engine_seconds(engine.url))
                del baseline_once
            phases = [r.seconds["buckets"] for r in reports]
            seconds, baseline = statistics.median(phases), statistics.median(baselines)
            result[name] = {
                "gb_per_s": total / seconds / 1e9,
                "baseline_gb_per_s": total / baseline / 1e9,
                "ratio": statistics.median(b / p for b, p in zip(baselines, phases)),
                "buckets": reports[-1].buckets,
                "bucket_phase_s": seconds,
                "total_s": statistics.median(r.seconds["total"] for r in reports),
                "phases_s": {
                    k: round(statistics.median(r.seconds.get(k, 0.0) for r in reports), 4) for k in reports[-1].seconds
                },
                "engine_s": {k: round((after[k] - before[k]) / rounds, 4) for k in after},
            }
            if floors:
                result[name]["two_copies"] = {
                    "seconds": statistics.median(floors),
                    "ceiling_ratio": statistics.median(b / f for b, f in zip(baselines, floors)),
                    "of_floor": statistics.median(f / p for f, p in zip(floors, phases)),
                }
            del two_copies
        if device == "cpu":
            result["tensor"]["repeated_call_ms"] = asyncio.run(
                repeated_call_ms(engine.url, weights, buffer_size, device)
            )
    finally:
        engine.terminate()
    return result


def bench_lora(path: Path, rank: int, rounds: int, buffer_size: int) -> dict:
    """A full update against an adapter-only update of the same model, each timed whole."""
    spec = ModelSpec.from_checkpoint(path)
    weights = checkpoint_tensors(path)
    torch.manual_seed(0)
    adapter = {
        tensor_name(layer, module, which): torch.randn(*((rank, n_in) if which == "A" else (n_out, rank))) * 0.01
        for layer in range(spec.num_layers)
        for module, (n_out, n_in) in module_shapes(spec).items()
        for which in "AB"
    }
    config = LoRAConfig(rank=rank, alpha=32.0, modules=tuple(module_shapes(spec))).to_peft(str(path))
    engine = start_engine(path, "cpu", "--enable-lora", "--max-lora-rank", str(rank))
    syncs = {
        "full": (
            WeightSync(
                TensorTransport(torch.device("cpu")), [engine.url], buffer_size=buffer_size, pause_mode="in_place"
            ),
            weights,
        ),
        "adapter": (
            WeightSync(
                TensorTransport(torch.device("cpu")),
                [engine.url],
                buffer_size=buffer_size,
                pause_mode="in_place",
                adapter=config,
            ),
            adapter,
        ),
    }
    reports: dict[str, list] = {name: [] for name in syncs}
    round_trips: list[float] = []  # one route the engine answers after a scheduler hop, as unload and load do

    async def round_trip() -> float:
        async with SGLangClient(engine.url) as server:
            await server.unload_lora_adapter("absent", missing_ok=True)  # connected, as an update's client is
            started = time.perf_counter()
            await server.unload_lora_adapter("absent", missing_ok=True)
            return time.perf_counter() - started

    try:
        for i in range(rounds + 1):  # the first round warms up
            for name, (sync, tensors) in syncs.items():
                report = asyncio.run(sync.update(tensors.items(), str(i)))
                if i:
                    reports[name].append(report)
            round_trips.append(asyncio.run(round_trip()))
    finally:
        engine.terminate()
    result = {
        name: {
            "bytes": runs[-1].bytes,
            "total_s": statistics.median(r.seconds["total"] for r in runs),
            "phases_s": {k: round(statistics.median(r.seconds.get(k, 0.0) for r in runs), 4) for k in runs[-1].seconds},
        }
        for name, runs in reports.items()
    }
    # No adapter update can take less than the phases every update pays whatever it moves (HTTP round
    # trips to connect, pause, version, continue), plus its own two (SGLang's unload, then load), plus
    # the adapter's bytes copied twice (packed here, copied out there) at memcpy speed: ``floor_ratio``
    # bounds ``ratio`` on this machine.
    fixed = statistics.median(
        sum(v for k, v in r.seconds.items() if k not in ("pack", "send", "adapter", "total"))
        for r in reports["adapter"]
    )
    nbytes = reports["adapter"][-1].bytes
    copy = statistics.median(memcpy_timer(nbytes, nbytes)() for _ in range(rounds))
    floor = fixed + 2 * statistics.median(round_trips[1:]) + 2 * copy
    return {
        "model": str(path),
        "rank": rank,
        **result,
        "fixed_s": round(fixed, 4),
        "floor_s": round(floor, 4),
        "floor_ratio": round(floor / result["full"]["total_s"], 4),
        "bytes_ratio": result["adapter"]["bytes"] / result["full"]["bytes"],
        "ratio": statistics.median(
            a.seconds["total"] / f.seconds["total"] for a, f in zip(reports["adapter"], reports["full"])
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="*", default=["small", "base"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024**2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--lora", action="store_true", help="adapter-only sync vs full sync of --model")
    parser.add_argument("--model", type=Path, help="checkpoint for --lora (e.g. models/smollm2-135m)")
    parser.add_argument("--lora-rank", type=int, default=16)
    args = parser.parse_args()
    if args.lora:
        result = bench_lora(args.model or model_dir("small"), args.lora_rank, args.rounds, args.buffer_size)
        print(
            json.dumps(
                {
                    "bench": "weight_sync",
                    "mode": "lora",
                    "threads": torch.get_num_threads(),
                    "targets": {"ratio": 0.05},
                    **result,
                },
                indent=2,
            )
        )
        return
    targets = {"tensor_ratio": 0.4, "distributed_ratio": 0.5} if args.device == "cpu" else {"tensor_ratio": 0.3}
    out = {
        "bench": "weight_sync",
        "device": args.device,
        "threads": torch.get_num_threads(),
        "buffer_size": args.buffer_size,
        "targets": targets,
    }
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    for preset in args.presets:
        out[preset] = bench_model(preset, args.rounds, args.buffer_size, args.device)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
