"""What a step's batch costs the job's driver: relayed (before #77) vs passed by reference (now). Prints JSON.

A step's batch goes from the Data Buffer to the trainer's ranks. Before, the driver relayed it: it read
the whole batch from the buffer and decoded its Samples, encoded each as JSON for the Ray call, and Ray
pickled that list; every rank then unpickled it and decoded the Samples again. Now the driver is served
the batch by reference (its request id, its groups' sizes and staleness: ``BufferClient.next_batch``),
passes that to the ranks, and each rank reads the Samples from the buffer itself
(``train.actor.read_samples``). The relay is reproduced here, operation for operation, as the baseline.

Both paths run against one real ``inverted buffer`` process over HTTP, on the same served batch, in
alternating rounds (medians reported). Per path: the driver's seconds and its peak of Python memory
(``tracemalloc``) for the batch, a rank's seconds to get the Samples, and their sum, the step's
overhead (Ray's copy of the relayed payload into each rank is not counted: the relay's figure is
a floor). Two batch shapes: ``agent``,
``make agent``'s (8 groups x 8 episodes of about 360 tokens: 64 Samples, 0.3 MB of JSON, as its
``buffer.db`` holds them), and ``long``, long-context agent episodes (64 Samples of 8,192 tokens).

    python bench/batch_relay.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.buffer.client import BufferAddress, read_batch  # noqa: E402
from inverted.processes import ManagedProcess, free_port  # noqa: E402
from inverted.train.actor import read_samples  # noqa: E402
from inverted.types import Sample, Task  # noqa: E402

GROUPS, GROUP_SIZE = 8, 8
T = TypeVar("T")
SHAPES = {"agent": (330, 3, 10), "long": (6_000, 8, 274)}  # prompt tokens, model calls, tokens per call


def episode(task: Task, prompt: int, calls: int, per_call: int) -> Sample:
    """A Sample shaped like a proxy-recorded agent episode: a prompt, then ``calls`` model calls, each
    followed by a tool result (masked out), with per-turn metadata as the proxy records it."""
    sample = task.new_sample()
    response = calls * per_call * 2
    sample.tokens = [(7 * i + task.index) % 49_000 for i in range(prompt + response)]
    sample.response_length = response
    sample.loss_mask = ([1] * per_call + [0] * per_call) * calls
    sample.rollout_log_probs = [-0.25 - (i % 13) / 10 for i in range(response)]
    sample.weight_versions = ["3"] * response
    sample.reward, sample.status = float(task.index % 2), Sample.Status.COMPLETED
    sample.metadata = {
        "turns": [
            {"finish_reason": "tool_calls", "prompt_tokens": prompt + 2 * per_call * i, "completion_tokens": per_call}
            for i in range(calls)
        ],
        "model": "policy",
    }
    return sample


class Driver:
    """The job's driver side: one event loop and one buffer client for the whole run, as the job has;
    every call is served a fresh batch (groups submitted beforehand, untimed)."""

    def __init__(self, address: BufferAddress, shape: tuple[int, int, int]):
        self.address, self.shape, self.served = address, shape, 0
        self.loop = asyncio.new_event_loop()
        self.client = address.client()

    def run(self, coroutine: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def submit_groups(self) -> None:
        async def submit() -> None:
            tasks = await self.client.lease(GROUPS * GROUP_SIZE, "bench")
            await self.client.submit([(task, episode(task, *self.shape)) for task in tasks])

        self.run(submit())

    def relayed(self) -> bytes:
        """Before: served the whole batch, its Samples decoded, each encoded for the Ray call, pickled."""
        self.served += 1
        body = {"num_groups": GROUPS, "request_id": f"batch:{self.served}", "samples": True}
        reply = self.run(self.client.request("POST", "/batches/next", json_body=body, timeout=60, idempotent=True))
        samples = read_batch(reply.content).samples
        return pickle.dumps([s.to_json() for s in samples], protocol=5)

    def by_reference(self) -> bytes:
        """Now: served the batch by reference, pickled for the Ray call with where to read it."""
        self.served += 1
        ref = self.run(self.client.next_batch(num_groups=GROUPS, request_id=f"batch:{self.served}"))
        return pickle.dumps((ref, self.address), protocol=5)

    def close(self) -> None:
        self.run(self.client.close())
        self.loop.close()


def relayed_rank(payload: bytes) -> list[Sample]:
    return [Sample.from_json(s) for s in pickle.loads(payload)]


def referenced_rank(payload: bytes) -> list[Sample]:
    ref, address = pickle.loads(payload)
    return read_samples(ref, address)


def measure(driver: Driver, hand_over: Callable[[], bytes], rank: Callable[[bytes], list[Sample]]) -> dict[str, float]:
    """One step's hand-over: the driver's part timed, then again on a fresh batch under ``tracemalloc``
    (which slows allocation) for its peak; then a rank's part, timed."""
    driver.submit_groups()
    started = time.perf_counter()
    payload = hand_over()
    driver_s = time.perf_counter() - started
    driver.submit_groups()
    tracemalloc.start()
    hand_over()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    started = time.perf_counter()
    samples = rank(payload)
    rank_s = time.perf_counter() - started
    assert len(samples) == GROUPS * GROUP_SIZE
    return {
        "driver_s": driver_s,
        "driver_peak_mb": peak / 2**20,
        "ray_payload_mb": len(payload) / 2**20,
        "rank_s": rank_s,
        "step_s": driver_s + rank_s,
    }


def median(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in rows), 5) for key in rows[0]}


def bench_shape(name: str, rounds: int, root: Path) -> dict:
    prompts = root / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"task {i}"}) + "\n" for i in range(GROUPS)))
    port = free_port()
    process = ManagedProcess.spawn(
        "bench-buffer",
        [
            sys.executable,
            "-m",
            "inverted.cli",
            "buffer",
            "--db",
            str(root / f"{name}.db"),
            "--prompt-data",
            str(prompts),
            "--n-samples-per-prompt",
            str(GROUP_SIZE),
            "--port",
            str(port),
            "--api-key",
            "bench",
            "--num-epoch",
            "1000",
        ],
        root / f"{name}.log",
        f"http://127.0.0.1:{port}",
    )
    try:
        process.wait_healthy(60)
        driver = Driver(BufferAddress(process.url, api_key="bench"), SHAPES[name])
        relay, reference = [], []
        try:
            for _ in range(rounds):  # alternating, so that drift in this VM's speed hits both alike
                relay.append(measure(driver, driver.relayed, relayed_rank))
                reference.append(measure(driver, driver.by_reference, referenced_rank))
        finally:
            driver.close()
    finally:
        process.terminate()
    relayed, referenced = median(relay), median(reference)
    prompt, calls, per_call = SHAPES[name]
    return {
        "batch": {"samples": GROUPS * GROUP_SIZE, "tokens": GROUPS * GROUP_SIZE * (prompt + calls * per_call * 2)},
        "relayed": relayed,
        "by_reference": referenced,
        "driver_memory_ratio": round(referenced["driver_peak_mb"] / relayed["driver_peak_mb"], 4),
        "driver_time_ratio": round(referenced["driver_s"] / relayed["driver_s"], 4),
        "step_overhead_ratio": round(referenced["step_s"] / relayed["step_s"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps({name: bench_shape(name, args.rounds, Path(tmp)) for name in args.shapes}, indent=2))


if __name__ == "__main__":
    main()
