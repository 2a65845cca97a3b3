"""Pause / continue / abort / flush / weight-version / disk-update semantics, as SGLang documents them."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.anyio

LONG = {"input_ids": [7, 8, 9], "sampling_params": {"max_new_tokens": 1200, "temperature": 0, "ignore_eos": True},
        "return_logprob": True}


@pytest.fixture
def engine(procs, tiny_model):
    """A fresh engine per test: these tests change its state."""
    return procs.engine(tiny_model("qwen2")).url


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
            "message": "Generation paused successfully.", "status": "ok"}
        aborted = await asyncio.wait_for(inflight, 30)
        assert aborted["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert 5 <= len(aborted["output_ids"]) < 1200
        assert (await client.get("/ready")).status_code == 503
        blocked = asyncio.create_task(client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 3}}))
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
    got = [lp for lp, _, _ in resumed["meta_info"]["output_token_logprobs"]]
    want = [lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


async def test_abort_request_by_rid_prefix_and_abort_all(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        a = await started(client, {**LONG, "rid": "group-1-a"})
        b = await started(client, {**LONG, "rid": "group-1-b"})
        c = await started(client, {**LONG, "rid": "other", "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 4000}})
        assert (await client.post("/abort_request", json={"rid": "nobody"})).status_code == 200
        response = await client.post("/abort_request", json={"rid": "group-1"})
        assert response.status_code == 200 and response.content == b""
        for task in (a, b):
            assert (await asyncio.wait_for(task, 30))["meta_info"]["finish_reason"]["type"] == "abort"
        await asyncio.sleep(0.3)
        assert not c.done()
        await client.post("/abort_request", json={"abort_all": True})
        assert (await asyncio.wait_for(c, 30))["meta_info"]["finish_reason"]["type"] == "abort"
        metrics = (await client.get("/metrics")).text
        assert "sglang:num_aborted_requests_total 3" in metrics


async def test_weight_version_and_spans_across_an_in_place_update(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        out = (await client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})).json()
        assert out["meta_info"]["weight_version"] == "default"
        response = await client.post("/update_weight_version", json={"new_version": "v1"})
        assert response.json() == {"success": True, "message": "Weight version updated to v1", "new_version": "v1"}
        assert (await client.get("/model_info")).json()["weight_version"] == "v1"
        task = await started(client, {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 2000}}, 10)
        await client.post("/pause_generation", json={"mode": "in_place"})
        await client.post("/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
        await client.post("/continue_generation", json={})
        meta = (await asyncio.wait_for(task, 60))["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] >= 10 and spans[1]["end"] == 2000
    assert meta["weight_version"] == "v2"


def test_update_weights_from_disk_swaps_weights_and_a_bad_checkpoint_changes_nothing(engine, tiny_model):
    new = tiny_model("qwen2", seed=1)
    body = {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    before = httpx.post(engine + "/generate", json=body, timeout=60).json()
    name = "model.layers.0.self_attn.q_proj.bias"
    old_values = httpx.post(engine + "/get_weights_by_name", json={"name": name}).json()

    for bad in (tiny_model("qwen3"), "/nonexistent/checkpoint"):  # wrong shapes, then nothing at all
        response = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(bad), "weight_version": "bad"}, timeout=60)
        assert response.status_code == 400 and response.json()["success"] is False
        assert "Rolled back" in response.json()["message"]
    still = httpx.post(engine + "/generate", json=body, timeout=60).json()
    assert still["output_ids"] == before["output_ids"] and still["meta_info"]["weight_version"] == "default"
    assert httpx.post(engine + "/get_weights_by_name", json={"name": name}).json() == old_values

    response = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(new), "weight_version": "step-1"}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json() == {"success": True, "num_paused_requests": 0,
                               "message": "Succeeded to update model weights. Weight version updated to step-1."}
    expected = load_file(str(new / "model.safetensors"))[name]
    got = torch.tensor(httpx.post(engine + "/get_weights_by_name", json={"name": name, "truncate_size": 5}).json())
    assert torch.equal(got, expected[:5])
    after = httpx.post(engine + "/generate", json=body, timeout=60).json()
    assert after["meta_info"]["weight_version"] == "step-1"
    assert after["output_ids"] != before["output_ids"]
    bad_name = httpx.post(engine + "/get_weights_by_name", json={"name": "no.such.weight"})
    assert bad_name.status_code == 400 and bad_name.json() == {"error": {"message": "Get parameter by name failed"}}


async def test_disk_update_waits_for_running_requests_unless_paused(engine, tiny_model):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        task = await started(client, {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 400}})
        update = await client.post("/update_weights_from_disk", json={"model_path": str(tiny_model("qwen2", seed=1)), "weight_version": "w1"})
        assert update.status_code == 200
        out = await asyncio.wait_for(task, 60)
        # Had the update not waited (SGLang's writer lock), later tokens would carry version w1.
        assert len(out["output_ids"]) == 400
        assert out["meta_info"]["weight_version"] == "default" and "weight_versions" not in out["meta_info"]


async def test_release_and_resume_memory(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        task = await started(client, LONG)
        busy = await client.post("/release_memory_occupation", json={})
        assert busy.status_code == 400 and "idle" in busy.json()["error"]["message"]
        await client.post("/pause_generation", json={"mode": "retract"})
        assert (await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).json() is None
        assert (await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})).json() is None
        await client.post("/continue_generation", json={})
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
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == info["served_model_name"]
