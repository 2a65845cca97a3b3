"""Pause / continue / abort / flush / weight-version / disk-update semantics, as SGLang documents them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import BACKENDS

pytestmark = pytest.mark.anyio

LONG = {
    "input_ids": [7, 8, 9],
    "sampling_params": {"max_new_tokens": 1200, "temperature": 0, "ignore_eos": True},
    "return_logprob": True,
}


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, module_procs, tiny_model):
    """The embedded engine, then real SGLang (the reference), each started once for the module: every test
    leaves the server serving, unpaused, and reads versions and counters relative to where it began."""
    return module_procs.server(request.param, tiny_model("qwen2")).url


@pytest.fixture(scope="module")
def embedded(module_procs, tiny_model):
    return module_procs.engine(tiny_model("qwen2")).url


async def version(client: httpx.AsyncClient) -> str:
    return (await client.get("/model_info")).json()["weight_version"]


async def started(client: httpx.AsyncClient, body: dict, min_tokens: int = 5) -> asyncio.Task:
    """Start a request and return once it is decoding (seen through the stream)."""
    seen = asyncio.Event()

    async def run() -> dict:
        last = None
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    last = json.loads(line[6:])
                    if len(last["output_ids"]) >= min_tokens:
                        seen.set()
        return last

    task = asyncio.create_task(run())
    await asyncio.wait_for(seen.wait(), 60)
    return task


async def test_pause_abort_aborts_in_flight_and_blocks_new_until_continue(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        inflight = await started(client, LONG)
        assert (await client.post("/pause_generation", json={"mode": "abort"})).json() == {
            "message": "Generation paused successfully.",
            "status": "ok",
        }
        aborted = await asyncio.wait_for(inflight, 30)
        assert aborted["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 5 <= len(aborted["output_ids"]) < 1200
        assert (await client.get("/ready")).status_code == 503
        blocked = asyncio.create_task(
            client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 3}})
        )
        await asyncio.sleep(1.0)
        assert not blocked.done(), "a generate call must wait while the engine is paused"
        await client.post("/continue_generation", json={})
        done = await asyncio.wait_for(blocked, 30)
        assert len(done.json()["output_ids"]) <= 3 and done.status_code == 200
        assert (await client.get("/ready")).status_code == 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_retract_and_in_place_resume_to_the_uninterrupted_result(engine, mode):
    body = {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 300}}
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        reference = (await client.post("/generate", json=body)).json()
        task = await started(client, body, min_tokens=20)
        await client.post("/pause_generation", json={"mode": mode})
        await asyncio.sleep(0.5)
        assert not task.done()
        flush = await client.post("/flush_cache")
        # SGLang: with retract the queue is ignored and the flush succeeds; in place keeps running requests.
        assert flush.status_code == (200 if mode == "retract" else 400), flush.text
        await client.post("/continue_generation", json={})
        resumed = await asyncio.wait_for(task, 60)
    assert resumed["output_ids"] == reference["output_ids"]
    assert resumed["meta_info"]["num_retractions"] == (1 if mode == "retract" else 0)
    got = [lp for lp, _, _ in resumed["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


async def test_an_answer_carries_sglangs_meta_info(engine):
    """The fields of real SGLang 0.5.23's ``meta_info`` besides the log-probs: the cache's share of the prompt
    (none the first time, all but the last token the second), retractions, reasoning tokens (none without a
    server-side reasoning parser), the data-parallel rank (none), and the weight-version spans, which SGLang
    reports once a request is done."""
    prompt = list(range(600, 640))
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        now = await version(client)
        first = (await client.post("/generate", json=body)).json()["meta_info"]
        second = (await client.post("/generate", json=body)).json()["meta_info"]
        chunks = []
        async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["meta_info"])
    for meta in (first, second, chunks[-1]):
        assert meta["num_retractions"] == 0 and meta["reasoning_tokens"] == 0 and meta["dp_rank"] is None
        assert meta["weight_versions"] == [{"version": now, "start": 0, "end": 4}] and meta["weight_version"] == now
    assert first["cached_tokens"] == 0 and first["cached_tokens_details"] is None
    assert second["cached_tokens"] == len(prompt) - 1
    assert second["cached_tokens_details"] == {"device": len(prompt) - 1, "host": 0}
    assert len(chunks) > 1 and not any("weight_versions" in meta for meta in chunks[:-1])


def held_sockets(pids: set[int]) -> set[str]:
    """The paths of the Unix sockets that the processes ``pids`` hold open."""
    paths = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        if len(fields := line.split()) >= 8:
            paths[f"socket:[{fields[6]}]"] = fields[7]
    held = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if (link := os.readlink(fd)) in paths:
                        held.add(paths[link])
    return held


def test_sglangs_ipc_sockets_are_in_its_launchers_scratch_folder(engine, module_procs):
    """The launcher removes its scratch folder when SGLang has exited, so SGLang's IPC sockets must be there:
    they were in /tmp, and every server left three (and as many empty files) there."""
    server = next(p for p in module_procs.procs if p.url == engine)
    if "sglang" not in server.name:
        pytest.skip("the embedded engine binds no Unix sockets")
    scratch = re.search(r"\[inverted\] scratch (\S+)", server.log_path.read_text()).group(1)
    launcher = server.popen.pid
    stats = {}  # pid: the fields after the name (state, ppid, pgid, ...)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
    sglang = {pid for pid, fields in stats.items() if int(fields[1]) == launcher}  # its fork: a group of its own
    group = {pid for pid, fields in stats.items() if int(fields[2]) in sglang}
    sockets = held_sockets(group | {launcher})
    assert len(sockets) >= 3 and all(path.startswith(scratch + "/") for path in sockets), (scratch, sockets)


async def test_abort_request_by_rid_and_abort_all(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        a = await started(client, {**LONG, "rid": "group-1-a"})
        b = await started(client, {**LONG, "rid": "group-1-b"})
        c = await started(
            client, {**LONG, "rid": "other", "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 4000}}
        )
        for unknown in ("nobody", "group-1"):  # SGLang aborts by a request's own id only, not by a prefix of ids
            response = await client.post("/abort_request", json={"rid": unknown})
            assert response.status_code == 200 and response.content == b""
        response = await client.post("/abort_request", json={"rid": "group-1-a"})
        assert response.status_code == 200 and response.content == b""
        assert (await asyncio.wait_for(a, 30))["meta_info"]["finish_reason"]["type"] == "abort"
        await asyncio.sleep(0.3)
        assert not b.done() and not c.done()
        await client.post("/abort_request", json={"abort_all": True})
        for task in (b, c):
            assert (await asyncio.wait_for(task, 30))["meta_info"]["finish_reason"]["type"] == "abort"


async def test_weight_version_and_spans_across_an_in_place_update(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        out = (
            await client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        ).json()
        assert out["meta_info"]["weight_version"] == await version(client)
        response = await client.post("/update_weight_version", json={"new_version": "v1"})
        assert response.json() == {"success": True, "message": "Weight version updated to v1", "new_version": "v1"}
        assert (await client.get("/model_info")).json()["weight_version"] == "v1"
        task = await started(
            client, {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 2000}}, 10
        )
        await client.post("/pause_generation", json={"mode": "in_place"})
        await client.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
        await client.post("/continue_generation", json={})
        meta = (await asyncio.wait_for(task, 60))["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 10 and spans[1]["end"] == 2000
    assert meta["weight_version"] == "v2"


def test_update_weights_from_disk_swaps_weights_and_a_missing_checkpoint_changes_nothing(engine, tiny_model):
    new = tiny_model("qwen2", seed=1)
    body = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    before = httpx.post(engine + "/generate", json=body, timeout=60).json()
    start = before["meta_info"]["weight_version"]
    response = httpx.post(
        engine + "/update_weights_from_disk",
        json={"model_path": "/nonexistent/checkpoint", "weight_version": "bad"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["success"] is False
    still = httpx.post(engine + "/generate", json=body, timeout=60).json()
    assert still["output_ids"] == before["output_ids"] and still["meta_info"]["weight_version"] == start

    response = httpx.post(
        engine + "/update_weights_from_disk", json={"model_path": str(new), "weight_version": "step-1"}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json() == {
        "success": True,
        "num_paused_requests": 0,
        "message": "Succeeded to update model weights. Weight version updated to step-1.",
    }
    after = httpx.post(engine + "/generate", json=body, timeout=60).json()
    assert after["meta_info"]["weight_version"] == "step-1"
    assert after["output_ids"] != before["output_ids"]
    bad_name = httpx.post(engine + "/get_weights_by_name", json={"name": "no.such.weight"})
    assert bad_name.status_code == 400 and bad_name.json() == {"error": {"message": "Get parameter by name failed"}}


def test_the_embedded_engine_refuses_a_checkpoint_that_does_not_fit_and_reads_weights_by_name(embedded, tiny_model):
    """Beyond SGLang (docs/sglang-differences.md): real SGLang 0.5.23 loads the tensors of another model's checkpoint
    whose names match and answers success, and cannot read a Qwen2 weight by name."""
    name = "model.layers.0.self_attn.q_proj.bias"
    old_values = httpx.post(embedded + "/get_weights_by_name", json={"name": name}).json()
    response = httpx.post(
        embedded + "/update_weights_from_disk",
        json={"model_path": str(tiny_model("qwen3")), "weight_version": "bad"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["success"] is False
    assert "Rolled back" in response.json()["message"]
    assert httpx.post(embedded + "/get_weights_by_name", json={"name": name}).json() == old_values
    new = tiny_model("qwen2", seed=1)
    assert (
        httpx.post(embedded + "/update_weights_from_disk", json={"model_path": str(new)}, timeout=60).status_code == 200
    )
    expected = load_file(str(new / "model.safetensors"))[name]
    got = torch.tensor(httpx.post(embedded + "/get_weights_by_name", json={"name": name, "truncate_size": 5}).json())
    assert torch.equal(got, expected[:5])


async def test_disk_update_waits_for_running_requests_unless_paused(engine, tiny_model):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        start = await version(client)
        task = await started(client, {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 400}})
        update = await client.post(
            "/update_weights_from_disk", json={"model_path": str(tiny_model("qwen2", seed=1)), "weight_version": "w1"}
        )
        assert update.status_code == 200
        out = await asyncio.wait_for(task, 60)
        # Had the update not waited (SGLang's writer lock), later tokens would carry version w1.
        assert len(out["output_ids"]) == 400
        assert out["meta_info"]["weight_version"] == start


async def test_release_and_resume_memory_while_paused(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        task = await started(client, LONG)
        await client.post("/pause_generation", json={"mode": "retract"})
        assert (await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).json() is None
        assert (await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})).json() is None
        await client.post("/continue_generation", json={})
        assert len((await asyncio.wait_for(task, 120))["output_ids"]) == 1200


async def test_the_embedded_engine_refuses_to_release_memory_while_busy(embedded):
    """Real SGLang 0.5.23 asserts that it is idle, and the failed assertion kills the server
    (docs/sglang-differences.md); the embedded engine refuses, and keeps serving."""
    async with httpx.AsyncClient(base_url=embedded, timeout=120) as client:
        task = await started(client, LONG)
        busy = await client.post("/release_memory_occupation", json={})
        assert busy.status_code == 400 and "idle" in busy.json()["error"]["message"]
        assert len((await asyncio.wait_for(task, 120))["output_ids"]) == 1200


async def test_health_generate_and_info_routes(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=60) as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health_generate")).status_code == 200
        info = (await client.get("/server_info")).json()
        assert info == (await client.get("/get_server_info")).json() | {"internal_states": info["internal_states"]}
        assert info["dp_size"] == 1 and info["served_model_name"].endswith("qwen2-tiny-0")
        model_info = (await client.get("/get_model_info")).json()
        assert model_info["architectures"] == ["Qwen2ForCausalLM"] and model_info["is_generation"] is True
        # a disk update (an earlier test's) renames the served model after its path, as SGLang does
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == model_info["served_model_name"]
