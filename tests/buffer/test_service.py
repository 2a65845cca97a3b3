"""The Data Buffer as a real process on a real SQLite file, driven by ``BufferClient`` over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import sqlite3
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from inverted.buffer.client import BufferClient
from inverted.errors import ProtocolError, ServiceUnavailable
from inverted.processes import tcp_sockets
from inverted.types import Sample
from tests.conftest import until

pytestmark = pytest.mark.anyio


@pytest.fixture
def dataset(tmp_path):
    def write(n: int) -> str:
        path = tmp_path / f"prompts-{n}.jsonl"
        path.write_text(
            "".join(json.dumps({"input": f"What is {i} + {i}?", "label": str(2 * i)}) + "\n" for i in range(n))
        )
        return str(path)

    return write


def fill(task, reward: float = 1.0, version: str = "0") -> Sample:
    sample = task.new_sample()
    sample.tokens, sample.response_length = [5, 6, 7, 8, 9], 3
    sample.loss_mask, sample.rollout_log_probs, sample.weight_versions = [1, 0, 1], [-0.1, 0.0, -0.3], [version] * 3
    sample.reward, sample.status = reward + task.index, Sample.Status.COMPLETED  # rewards differ within a group
    return sample


def db_rows(path) -> list[tuple[int, int]]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT group_index, sample_index FROM samples ORDER BY 1, 2").fetchall()


async def test_kill_9_loses_no_acknowledged_sample_and_releases_the_rest(procs, tmp_path, dataset):
    db = tmp_path / "buffer.db"
    args = ["--prompt-data", dataset(60), "--n-samples-per-prompt", "2", "--num-epoch", "1", "--lease-seconds", "2"]
    buffer = procs.buffer(db, *args)
    acknowledged: set[tuple[int, int]] = set()
    leased: set[tuple[int, int]] = set()

    async def worker(name: str) -> None:
        async with BufferClient(buffer.url, max_attempts=1) as client:
            try:
                while True:
                    tasks = await client.lease(3, name)
                    if not tasks:
                        return
                    leased.update((t.group_index, t.index) for t in tasks)
                    await client.submit([(t, fill(t)) for t in tasks])
                    acknowledged.update((t.group_index, t.index) for t in tasks)
            except ServiceUnavailable:
                return  # the service was killed under us

    async def killer() -> None:
        while len(acknowledged) < 40:
            await asyncio.sleep(0.01)
        os.kill(buffer.popen.pid, signal.SIGKILL)

    await asyncio.gather(killer(), *(worker(f"w{i}") for i in range(4)))
    buffer.popen.wait()
    rows = db_rows(db)
    assert acknowledged <= set(rows) and len(rows) == len(set(rows))  # every acknowledged sample, exactly once
    assert len(acknowledged) < 120

    # Restart on the same file: the leases of the dead workers expire, and exactly the missing tasks come back.
    buffer = procs.buffer(db, *args)
    await asyncio.sleep(2.1)
    async with BufferClient(buffer.url) as client:
        again = await client.lease(1000, "survivor")
        assert {(t.group_index, t.index) for t in again} == {(g, i) for g in range(60) for i in range(2)} - set(rows)
        await client.submit([(t, fill(t)) for t in again])
        stats = await client.stats()
    assert (
        stats["samples"] == 120
        and stats["groups"]["complete"] == 60
        and stats["tasks"] == {"queued": 0, "leased": 0, "done": 120}
    )
    assert db_rows(db) == [(g, i) for g in range(60) for i in range(2)]


@pytest.mark.parametrize("workers", [1, 2])  # 2: two service processes share the database
async def test_8_submitters_2_consumers_nothing_lost_nothing_served_twice(procs, tmp_path, dataset, workers):
    groups, size = 600, 4
    buffer = procs.buffer(
        tmp_path / "b.db",
        "--prompt-data",
        dataset(groups),
        "--n-samples-per-prompt",
        str(size),
        "--num-epoch",
        "1",
        "--workers",
        str(workers),
    )
    served: list[list[Sample]] = []
    steps = itertools.count()
    done_submitting = asyncio.Event()

    async def submitter(name: str) -> None:
        async with BufferClient(buffer.url) as client:
            while tasks := await client.lease(16, name):
                await client.submit([(t, fill(t)) for t in tasks])

    async def consumer() -> None:
        async with BufferClient(buffer.url) as client:
            while True:
                ref = await client.next_batch(num_groups=8, timeout_s=0.5, allow_partial=done_submitting.is_set())
                if ref.sizes:  # trained: the step that did it is recorded, whichever worker process answers
                    batch = await client.batch(ref.request_id)  # its Samples, by the request it was served under
                    assert batch is not None and [len(g) for g in batch.groups] == list(ref.sizes)
                    served.extend(batch.groups)
                    assert await client.trained(ref.batch_id, next(steps)) == len(ref.sizes)
                if done_submitting.is_set() and not ref.sizes:
                    return

    async def submit_all() -> None:
        await asyncio.gather(*(submitter(f"s{i}") for i in range(8)))
        done_submitting.set()

    await asyncio.wait_for(asyncio.gather(submit_all(), consumer(), consumer()), 240)
    assert sorted(g[0].group_index for g in served) == list(range(groups))  # every group, once
    assert all(
        [s.index for s in g] == list(range(size)) and {s.group_index for s in g} == {g[0].group_index} for g in served
    )
    assert all(s.tokens == [5, 6, 7, 8, 9] and s.weight_versions == ["0"] * 3 for g in served for s in g)
    stats = httpx.get(buffer.url + "/stats").json()
    assert stats["groups"]["consumed"] == groups and stats["samples"] == groups * size
    assert stats["counters"]["groups_trained"] == groups


def connections_by_process(port: int) -> Counter[int]:
    """pid -> the accepted connections on ``port`` it holds (which process owns each socket, from /proc)."""
    inodes = tcp_sockets(port, "01")
    owners: Counter[int] = Counter()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    owners[int(pid)] += 1
    return owners


def workers_of(pid: int) -> set[int]:
    """The live worker processes of a ``--workers`` buffer (not multiprocessing's resource tracker)."""
    return {
        int(child)
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if b"spawn_main" in cmdline(int(child))
    }


def cmdline(pid: int) -> bytes:
    """The process's command line; empty once it has exited (a zombie's too)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_workers_share_a_burst_of_connections_and_a_dead_worker_is_replaced(procs, tmp_path, dataset):
    buffer = procs.buffer(
        tmp_path / "b.db", "--prompt-data", dataset(4), "--n-samples-per-prompt", "2", "--workers", "2"
    )
    port = int(buffer.url.rsplit(":", 1)[1])
    # Healthy means one worker listens; wait for the second.
    until(lambda: len(tcp_sockets(port, "0A")) == 2, "the second worker never listened")
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]  # a pool opening at once
    for client in clients:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: buffer\r\n\r\n")
    assert all(client.recv(4096).startswith(b"HTTP/1.1 200") for client in clients)
    owners = connections_by_process(port)
    assert sum(owners.values()) == 16 and len(owners) == 2, (
        owners
    )  # both workers serve (a shared socket can pile them onto one)
    for client in clients:
        client.close()

    dead = min(owners)
    os.kill(dead, signal.SIGKILL)
    until(
        lambda: len(workers_of(buffer.popen.pid) - {dead}) == 2 and len(tcp_sockets(port, "0A")) == 2,
        "the dead worker was not replaced by one that listens",
    )
    workers = workers_of(buffer.popen.pid)
    os.kill(buffer.popen.pid, signal.SIGKILL)  # the supervisor dies: its workers follow
    until(lambda: not any(cmdline(pid) for pid in workers), "workers outlived their supervisor", timeout=30)


async def test_long_poll_wakes_when_a_group_completes(procs, tmp_path, dataset):
    buffer = procs.buffer(tmp_path / "b.db", "--prompt-data", dataset(4), "--n-samples-per-prompt", "2")
    async with BufferClient(buffer.url) as client:
        tasks = await client.lease(2, "w")
        started = time.monotonic()
        waiting = asyncio.create_task(client.next_batch(num_groups=1, timeout_s=30))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await client.submit([(t, fill(t)) for t in tasks])
        ref = await asyncio.wait_for(waiting, 10)
        batch = await client.batch(ref.request_id)
        assert time.monotonic() - started < 5 and [s.index for s in batch.samples] == [0, 1]
        empty = await client.next_batch(num_groups=1, timeout_s=0.3)
        assert empty.sizes == () and empty.batch_id is None


def test_bad_input_is_422_naming_the_field_and_stores_nothing(procs, tmp_path, dataset):
    buffer = procs.buffer(
        tmp_path / "b.db", "--prompt-data", dataset(4), "--n-samples-per-prompt", "2", "--api-key", "k"
    )
    headers = {"Authorization": "Bearer k"}
    assert httpx.get(buffer.url + "/health").status_code == 200
    assert httpx.get(buffer.url + "/stats").status_code == 401
    tasks = httpx.post(buffer.url + "/tasks/lease", json={"count": 2, "worker_id": "w"}, headers=headers).json()[
        "tasks"
    ]
    good = {
        "group_index": 0,
        "index": 0,
        "tokens": [1, 2, 3],
        "response_length": 2,
        "loss_mask": [1, 1],
        "rollout_log_probs": [-1.0, -2.0],
        "weight_versions": ["0", "0"],
        "reward": 1.0,
        "status": "completed",
    }
    cases = [
        ({"loss_mask": [1]}, "samples[1].loss_mask"),
        ({"rollout_log_probs": [-1.0]}, "samples[1].rollout_log_probs"),
        ({"weight_versions": ["0"]}, "samples[1].weight_versions"),
        ({"response_length": 7}, "samples[1].response_length"),
        ({"group_index": 42}, "samples[1].group_index"),
        ({"reward": "NaN"}, "samples[1].reward"),
        ({"tokens": "abc"}, "samples[1].tokens"),
        ({"status": "exploded"}, "samples[1].status"),
        ({"colour": "red"}, "samples[1]"),
    ]
    for change, field in cases:
        body = {
            "samples": [
                {"lease_id": tasks[0]["lease_id"], "sample": good},
                {"lease_id": tasks[1]["lease_id"], "sample": {**good, "index": 1, **change}},
            ]
        }
        response = httpx.post(buffer.url + "/samples", json=body, headers=headers)
        assert response.status_code == 422, (change, response.text)
        assert response.json()["error"]["message"].startswith(field), response.json()
    for path, body in (
        ("/tasks/lease", {"count": 0, "worker_id": "w"}),
        ("/tasks/lease", {"count": 1}),
        ("/batches/next", {"num_groups": 1, "num_samples": 2}),
        ("/batches/next", {"num_samples": 3}),
        ("/tasks/release", {"worker_id": ""}),
        ("/tasks/release", {"worker": "w"}),
    ):
        response = httpx.post(buffer.url + path, json=body, headers=headers)
        assert response.status_code == 422 and response.json()["error"]["type"] in (
            "invalid_request_error",
            "invalid_sample",
        )
    malformed = httpx.post(buffer.url + "/samples", content=b'{"samples": [', headers=headers)
    assert malformed.status_code == 422 and "malformed JSON" in malformed.json()["error"]["message"]
    shapeless = httpx.post(buffer.url + "/samples", headers=headers, json={"samples": [{"sample": good}]})
    assert shapeless.status_code == 422 and "lease_id" in shapeless.json()["error"]["message"]
    stolen = httpx.post(
        buffer.url + "/samples", headers=headers, json={"samples": [{"lease_id": "guessed", "sample": good}]}
    )
    assert stolen.status_code == 409
    assert httpx.get(buffer.url + "/stats", headers=headers).json()["samples"] == 0
    ok = httpx.post(
        buffer.url + "/samples", headers=headers, json={"samples": [{"lease_id": tasks[0]["lease_id"], "sample": good}]}
    )
    assert ok.json() == {"accepted": 1, "duplicates": 0, "requeued": 0, "completed_groups": []}
    metrics = httpx.get(buffer.url + "/metrics", headers=headers).text
    assert 'inverted_buffer_tasks{state="done"} 1' in metrics and "inverted_buffer_samples 1" in metrics
    httpx.post(
        buffer.url + "/samples",
        headers=headers,
        json={"samples": [{"lease_id": tasks[1]["lease_id"], "sample": {**good, "index": 1}}]},
    )
    served = httpx.post(buffer.url + "/batches/next", headers=headers, json={"num_groups": 1}).json()["batch_id"]
    for body, status in (({"step": -1}, 422), ({}, 422), ({"step": 2, "epoch": 1}, 422)):
        assert httpx.post(f"{buffer.url}/batches/{served}/trained", headers=headers, json=body).status_code == status
    assert httpx.post(f"{buffer.url}/batches/{served}/trained", json={"step": 2}).status_code == 401
    assert httpx.post(f"{buffer.url}/batches/unknown/trained", headers=headers, json={"step": 2}).status_code == 404
    assert httpx.post(f"{buffer.url}/batches/{served}/trained", headers=headers, json={"step": 2}).json() == {
        "groups": 1
    }
    twice = httpx.post(f"{buffer.url}/batches/{served}/trained", headers=headers, json={"step": 3})
    assert twice.status_code == 409 and "trained in step 2 already" in twice.json()["error"]["message"]


async def test_client_errors_name_the_problem(procs, tmp_path, dataset):
    buffer = procs.buffer(tmp_path / "b.db", "--prompt-data", dataset(2))
    async with BufferClient(buffer.url) as client:
        task = (await client.lease(1, "w"))[0]
        broken = fill(task)
        broken.loss_mask = [1]
        with pytest.raises(ProtocolError) as info:
            await client.submit([(task, broken)])
        assert info.value.status == 422 and "loss_mask" in info.value.body


async def test_every_worker_process_loads_a_slime_filter(procs, tmp_path, dataset):
    """Each of ``--workers 2``'s processes runs the command line's set-up first, so a filter written in
    slime's form (adapted by ``compat``) loads there too: groups whose rewards all agree are filtered."""
    buffer = procs.buffer(
        tmp_path / "b.db",
        "--prompt-data",
        dataset(8),
        "--n-samples-per-prompt",
        "2",
        "--workers",
        "2",
        "--dynamic-sampling-filter-path",
        "tests.compat.slime_plugins:keep_differing_rewards",
    )
    async with BufferClient(buffer.url) as client:
        tasks = await client.lease(16, "w")
        # odd groups' rewards agree (filtered), even groups' differ (kept); each submission to any worker
        await asyncio.gather(
            *(client.submit([(t, fill(t, reward=-t.index if t.group_index % 2 else 0.0))]) for t in tasks)
        )
        ref = await client.next_batch(num_groups=8, timeout_s=1, allow_partial=True)
        batch = await client.batch(ref.request_id)
        stats = await client.stats()
    assert sorted(g[0].group_index % 2 for g in batch.groups) == [0, 0, 0, 0]
    assert stats["groups"]["filtered"] == 4 and stats["groups"]["consumed"] == 4


async def test_a_batch_is_served_by_reference_and_its_samples_read_by_its_request_id(procs, tmp_path, dataset):
    """The job's driver is served a batch by reference (its id, each group's size and staleness); the
    trainer's ranks read its Samples, byte for byte as submitted, by the request it was served under."""
    buffer = procs.buffer(tmp_path / "b.db", "--prompt-data", dataset(4), "--n-samples-per-prompt", "2")
    async with BufferClient(buffer.url) as client:
        tasks = await client.lease(6, "w")
        submitted = {(t.group_index, t.index): fill(t, version="1") for t in tasks}
        await client.submit([(t, submitted[t.group_index, t.index]) for t in tasks])
        ref = await client.next_batch(num_groups=2, current_weight_version=3, request_id="batch:7")
        assert (ref.request_id, ref.sizes, ref.staleness, ref.num_samples) == ("batch:7", (2, 2), (2, 2), 4)
        assert await client.served_batch("batch:7") == ref  # found again by reference, consuming nothing
        batch = await client.batch("batch:7")
        assert batch is not None and batch.batch_id == ref.batch_id and batch.staleness == [2, 2]
        assert [s.to_json() for s in batch.samples] == [
            submitted[s.group_index, s.index].to_json() for s in batch.samples
        ]
        assert await client.served_batch("batch:8") is None and await client.batch("batch:8") is None
        # a fresh request for the next batch is a new batch: the third group
        assert (await client.next_batch(num_groups=1, allow_partial=True)).sizes == (2,)
    by_ref = httpx.get(f"{buffer.url}/batches/batch:7", params={"samples": "false"}).json()
    assert by_ref == {"batch_id": ref.batch_id, "groups": [], "sizes": [2, 2], "staleness": [2, 2]}


def test_a_rank_reads_its_batch_by_reference_with_the_driver_s_filter_marks(procs, tmp_path, dataset):
    """``train.actor.read_samples``, as a trainer rank runs it (no event loop of its own): the Samples of
    the batch, and those the driver's sample filter left out of the loss marked so, by position."""
    from inverted.buffer.client import BufferAddress
    from inverted.train.actor import read_samples

    buffer = procs.buffer(
        tmp_path / "b.db", "--prompt-data", dataset(2), "--n-samples-per-prompt", "2", "--api-key", "k"
    )

    async def serve():
        async with BufferAddress(buffer.url, api_key="k").client() as client:
            tasks = await client.lease(4, "w")
            await client.submit([(t, fill(t)) for t in tasks])
            return await client.next_batch(num_groups=2)

    ref = dataclasses.replace(asyncio.run(serve()), removed=frozenset({1, 2}))
    samples = read_samples(ref, BufferAddress(buffer.url, api_key="k"))
    assert [(s.group_index, s.index, s.remove_sample) for s in samples] == [
        (0, 0, False),
        (0, 1, True),
        (1, 0, True),
        (1, 1, False),
    ]
    with pytest.raises(ProtocolError, match="401"):  # the buffer's key, or nothing
        read_samples(ref, BufferAddress(buffer.url, api_key="wrong"))


async def test_a_tasks_fan_out_is_stored_together_and_served_as_samples_of_its_group(procs, tmp_path, dataset):
    """Several Samples of one task (a fan-out) are submitted with its lease, stored as the task's one row,
    counted in its group's size, seen as Samples of their own by the buffer's filter and served so,
    in their order; a bad one is refused with the rest, naming where it is."""
    buffer = procs.buffer(
        tmp_path / "b.db",
        "--prompt-data",
        dataset(2),
        "--n-samples-per-prompt",
        "2",
        "--dynamic-sampling-filter-path",
        "tests.compat.slime_plugins:keep_differing_rewards",
    )
    async with BufferClient(buffer.url) as client:
        tasks = await client.lease(4, "w")
        first, other = tasks[0], tasks[1]  # group 0: task 0 fans out into three, rewards 1, 7, 8
        fanned = [fill(first), fill(first, reward=7.0), fill(first, reward=8.0)]
        bad = fill(first)
        bad.loss_mask = [1]
        with pytest.raises(ProtocolError, match=r"metadata\.siblings\[0\]: .*loss_mask"):
            await client.submit([(first, fanned[0]), (first, bad)])
        accepted = await client.submit([(first, s) for s in fanned] + [(other, fill(other))])
        assert accepted["accepted"] == 2
        # group 1's two tasks share a reward: the filter sees them so, and sets the group aside
        await client.submit([(t, fill(t, reward=-t.index)) for t in tasks[2:]])
        ref = await client.next_batch(num_groups=2, timeout_s=1, allow_partial=True)
        assert ref.sizes == (4,)
        batch = await client.batch(ref.request_id)
    assert batch is not None
    assert [(s.group_index, s.index, s.reward) for s in batch.samples] == [
        (0, 0, 1.0),
        (0, 0, 7.0),
        (0, 0, 8.0),
        (0, 1, 2.0),
    ]
    assert not any("siblings" in s.metadata for s in batch.samples)
    assert len(db_rows(tmp_path / "b.db")) == 4  # one row a task
