"""Data Buffer ingest throughput and batch-fetch latency, over HTTP vs the store in-process. Prints JSON.

The same samples (1,024 tokens each: 256 prompt + 768 response, with logprobs, mask and versions) are
written twice, in requests of 64: once through ``SQLiteStore.submit`` in this process (the baseline:
SQLite with fsync on every commit), once through a real ``inverted buffer`` process over HTTP from
concurrent clients with pre-encoded bodies (the job's own ``BufferClient``). Then batches of 64 samples
are fetched both ways (over HTTP, decoded into Samples as the trainer gets them). The ratio HTTP /
in-process is what the service layer costs. Rounds alternate the two paths and the medians are reported
(this VM's speed drifts between runs).

    python bench/buffer_throughput.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inverted.buffer.client import BufferClient  # noqa: E402
from inverted.buffer.datasets import load_prompts  # noqa: E402
from inverted.buffer.store import SQLiteStore  # noqa: E402
from inverted.processes import (  # noqa: E402
    ManagedProcess,
    free_port,
    tcp_sockets,  # noqa: E402
)
from inverted.types import Sample  # noqa: E402

GROUP = 8
PER_REQUEST = 64


def make_sample(group_index: int, index: int, prompt: str, response_len: int = 768, prompt_len: int = 256) -> Sample:
    n = group_index * GROUP + index
    return Sample(
        group_index=group_index,
        index=index,
        prompt=prompt,
        tokens=[(n + i) % 150000 for i in range(prompt_len + response_len)],
        response_length=response_len,
        loss_mask=[1] * response_len,
        rollout_log_probs=[-0.5 - (i % 7) * 0.01 for i in range(response_len)],
        weight_versions=["3"] * response_len,
        reward=float(index % 2),
        status=Sample.Status.COMPLETED,
    )


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def in_process(db: Path, data: str, prompts: int, batches: int) -> dict:
    records = load_prompts(data, input_key="input", label_key=None, metadata_key=None, tool_key=None)
    store = SQLiteStore(str(db), n_samples_per_prompt=GROUP, prompts=records, num_epoch=1)
    tasks = store.lease(prompts * GROUP, "bench", 3600)
    items = [(t["lease_id"], make_sample(t["group_index"], t["index"], t["prompt"])) for t in tasks]
    start = time.perf_counter()
    for chunk in chunks(items, PER_REQUEST):
        store.submit(chunk)
    elapsed = time.perf_counter() - start
    latencies = []
    for _ in range(batches):
        t0 = time.perf_counter()
        store.next_batch(PER_REQUEST // GROUP, 3, None)
        latencies.append(time.perf_counter() - t0)
    store.close()
    return {"samples_per_s": len(items) / elapsed, "batch_latency_ms": latencies}


async def over_http(url: str, prompts: int, batches: int, concurrency: int) -> dict:
    async with BufferClient(url) as client:  # the job's own client (aiohttp, retries)
        tasks = await client.lease(prompts * GROUP, "bench")
        bodies = [
            orjson.dumps(
                {
                    "samples": [
                        {"lease_id": t.lease_id, "sample": make_sample(t.group_index, t.index, t.prompt).to_json()}
                        for t in chunk
                    ]
                }
            )
            for chunk in chunks(tasks, PER_REQUEST)
        ]
        queue = list(bodies)

        async def sender() -> None:
            while queue:
                await client.request("POST", "/samples", content=queue.pop(), timeout=120, idempotent=True)

        start = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        latencies = []
        for _ in range(batches):
            t0 = time.perf_counter()
            # served by reference, then its Samples read by the request id, as a trainer rank reads them
            ref = await client.next_batch(num_samples=PER_REQUEST, current_weight_version=3)
            batch = await client.batch(ref.request_id)
            assert batch is not None and len(batch.groups) == len(ref.sizes) == PER_REQUEST // GROUP
            latencies.append(time.perf_counter() - t0)
    return {"samples_per_s": len(tasks) / elapsed, "batch_latency_ms": latencies}


def summary(latencies: list[float]) -> dict:
    ms = sorted(x * 1000 for x in latencies)
    return {"p50": round(statistics.median(ms), 2), "p95": round(ms[int(0.95 * (len(ms) - 1))], 2)}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=400, help="groups of 8 samples (default: 3,200 samples)")
    parser.add_argument("--batches", type=int, default=20, help="batches of 64 samples fetched for the latency figures")
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent HTTP submitters")
    parser.add_argument("--workers", type=int, default=3, help="buffer service processes (--workers)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds; the medians are reported")
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "prompts.jsonl"
        data.write_text("".join(json.dumps({"input": f"prompt {i}"}) + "\n" for i in range(args.prompts)))
        for r in range(args.repeat):
            local = in_process(Path(tmp) / f"local-{r}.db", str(data), args.prompts, args.batches)
            port = free_port()
            proc = ManagedProcess.spawn(
                "bench-buffer",
                [
                    sys.executable,
                    "-m",
                    "inverted.cli",
                    "buffer",
                    "--db",
                    f"{tmp}/http-{r}.db",
                    "--port",
                    str(port),
                    "--prompt-data",
                    str(data),
                    "--n-samples-per-prompt",
                    str(GROUP),
                    "--num-epoch",
                    "1",
                    "--workers",
                    str(args.workers),
                ],
                Path(tmp) / f"buffer-{r}.log",
                f"http://127.0.0.1:{port}",
            )
            try:
                proc.wait_healthy(60)  # one worker serves: wait for all, or the rest boot inside the timing
                while len(tcp_sockets(port, "0A")) < args.workers:
                    proc.check_alive()
                    time.sleep(0.1)
                remote = asyncio.run(over_http(proc.url, args.prompts, args.batches, args.concurrency))
            finally:
                proc.terminate()
            rounds.append((local, remote))
    local_sps = [lo["samples_per_s"] for lo, _ in rounds]
    http_sps = [re["samples_per_s"] for _, re in rounds]
    ratios = [h / lo for lo, h in zip(local_sps, http_sps)]
    http_median, ratio_median = statistics.median(http_sps), statistics.median(ratios)
    print(
        json.dumps(
            {
                "bench": "buffer_throughput",
                "samples": args.prompts * GROUP,
                "tokens_per_sample": 1024,
                "samples_per_request": PER_REQUEST,
                "http_concurrency": args.concurrency,
                "service_workers": args.workers,
                "rounds": [
                    {"in_process_samples_per_s": round(lo, 1), "http_samples_per_s": round(h, 1), "ratio": round(q, 3)}
                    for lo, h, q in zip(local_sps, http_sps, ratios)
                ],
                "in_process": {
                    "samples_per_s": round(statistics.median(local_sps), 1),
                    "batch_latency_ms": summary([x for lo, _ in rounds for x in lo["batch_latency_ms"]]),
                },
                "http": {
                    "samples_per_s": round(http_median, 1),
                    "batch_latency_ms": summary([x for _, re in rounds for x in re["batch_latency_ms"]]),
                },
                "ratio_http_to_in_process": round(ratio_median, 3),
                "target": {
                    "http_samples_per_s": 2000,
                    "min_ratio": 0.5,
                    "met": http_median >= 2000 and ratio_median >= 0.5,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
