"""The engine's weight-update routes as SGLang defines them: sessions, atomic checks, groups, in-flight requests."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from inverted.errors import ProtocolError
from inverted.hf_checkpoint import checkpoint_tensors
from inverted.processes import free_port
from inverted.rollout.sglang_client import SGLangClient
from inverted.train.weight_sync import Bucket, BucketPacker, DiskTransport, TensorTransport, WeightSync
from inverted.train.weight_sync.transports import dtype_name
from inverted.weight_wire import bucket_layout, bucket_payload, join_update_group
from tests.conftest import BACKENDS
from tests.engine.test_control import LONG, started

pytestmark = pytest.mark.anyio
NAME = "model.layers.0.self_attn.o_proj.weight"
IN_FLIGHT_TOKENS = 3000  # a request still running when an update pauses the engine (the context is 4,096)


@pytest.fixture
def engine(procs, tiny_model):
    return procs.engine(tiny_model("qwen2")).url


def packed(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.float32, *, shared: bool = True) -> Bucket:
    """One bucket, packed by the trainer's own packer into its own buffer (shared memory, as the tensor transport's)."""
    allocate = (
        TensorTransport(torch.device("cpu")).allocate if shared else (lambda n: torch.empty(n, dtype=torch.uint8))
    )
    # As large as the tensors: a shared buffer a server still maps outlives the test (RAM, in /dev/shm).
    (bucket,) = BucketPacker(sum(t.numel() for _, t in named) * dtype.itemsize, allocate, dtype).pack(named)
    return bucket


def payload_of(bucket: Bucket) -> str:
    return bucket_payload(bucket.flat, bucket.metadata)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def state(url: str) -> tuple[list, str]:
    return post(url, "/get_weights_by_name", {"name": NAME, "truncate_size": 2}).json(), httpx.get(
        url + "/model_info"
    ).json()["weight_version"]


def weight_load_metrics(url: str) -> dict[str, float]:
    """The engine's counters of weight loads: how many, and seconds receiving, decoding and copying."""

    async def read() -> dict[str, float]:
        async with SGLangClient(url) as client:
            return await client.metrics()

    return {
        k.removeprefix("inverted:weight_"): v
        for k, v in asyncio.run(read()).items()
        if k.removeprefix("inverted:weight_").startswith(("loads", "receive", "decode", "copy"))
    }


def test_session_rules(engine):
    bucket = packed([(NAME, torch.zeros(64, 64))])  # the sender keeps its bucket alive until the call returns
    payload = payload_of(bucket)
    outside = post(
        engine,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"},
    )
    assert outside.status_code == 400 and outside.json() == {
        "success": False,
        "message": "update_weights_from_tensor must run between begin_weight_update() and end_weight_update().",
    }
    assert post(engine, "/end_weight_update", {}).status_code == 400
    assert post(engine, "/begin_weight_update", {"selector": "all"}).json() == {
        "success": True,
        "message": "Weight update session started.",
    }
    second = post(engine, "/begin_weight_update", {})
    assert second.status_code == 400 and "already open" in second.json()["message"]
    assert post(engine, "/end_weight_update", {}).status_code == 200


def test_bad_payloads_change_nothing(engine, tiny_model):
    before = state(engine)
    good = checkpoint_tensors(tiny_model("qwen2", seed=5))
    buckets = {  # kept alive until the calls return, as a sender must
        "unknown parameter names": packed([("model.layers.9.mlp.up_proj.weight", good[NAME]), (NAME, good[NAME])]),
        "expected shape": packed([(NAME, good[NAME]), ("model.norm.weight", torch.ones(63))]),
        "expected dtype": packed([(NAME, good[NAME])], torch.bfloat16),
        "whole": packed([(NAME, good[NAME])]),
    }
    whole = payload_of(buckets.pop("whole"))
    # NaN and inf, packed by hand: the trainer's packer refuses to pack them (test_buckets).
    poisoned = good[NAME].clone()
    poisoned[0, 0], poisoned[1, 1] = float("nan"), float("inf")
    layout = bucket_layout(
        [
            (NAME, torch.float32, tuple(poisoned.shape)),
            ("model.norm.weight", torch.float32, tuple(good["model.norm.weight"].shape)),
        ]
    )
    flat = torch.cat([poisoned.reshape(-1), good["model.norm.weight"]]).view(torch.uint8).share_memory_()
    bad = {
        "NaN or inf values refused": bucket_payload(flat, layout),
        **{reason: payload_of(bucket) for reason, bucket in buckets.items()},
        "not valid base64": whole[:-13],
        "cannot decode the payload": whole[:-12],  # whole base64 groups, but the pickle stops early
        "not allowed": __import__("base64").b64encode(__import__("pickle").dumps(print)).decode(),
    }
    post(engine, "/begin_weight_update", {})
    for reason, payload in bad.items():
        response = post(
            engine,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload], "load_format": "flattened_bucket", "weight_version": "bad"},
        )
        assert response.status_code == 400 and response.json()["success"] is False, reason
        assert reason in response.json()["message"], (reason, response.json())
    two_ranks = post(
        engine,
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [bad["expected dtype"]] * 2, "load_format": "flattened_bucket"},
    )
    assert two_ranks.status_code == 400 and "one per server TP rank" in two_ranks.json()["message"]
    post(engine, "/end_weight_update", {})
    assert state(engine) == before  # the good tensors of a bad payload were not applied either


def test_a_repeated_payload_loads_what_its_shared_memory_holds_now(engine, tiny_model):
    """A trainer reuses its buffers, so it sends the same payload string at every update: the engine
    may reuse what it decoded, but must load the bytes the memory holds now. A refused payload stays refused."""
    shape = checkpoint_tensors(tiny_model("qwen2"))[NAME].shape
    bucket = packed([(NAME, torch.zeros(shape))])
    payload = payload_of(bucket)
    wrong_shape = packed([(NAME, torch.zeros(shape[0], shape[1] + 1))])
    post(engine, "/begin_weight_update", {})
    for value in (1.0, 2.0, -3.0):
        bucket.flat.view(torch.float32).fill_(value)  # what the trainer's next pack does
        response = post(
            engine,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"},
        )
        assert response.status_code == 200, response.text
        assert torch.tensor(state(engine)[0]).unique().tolist() == [value]
        refused = post(
            engine,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload_of(wrong_shape)], "load_format": "flattened_bucket"},
        )
        assert refused.status_code == 400 and "expected shape" in refused.json()["message"]
    post(engine, "/end_weight_update", {})
    loads = weight_load_metrics(engine)  # the refusals are not loads
    assert loads["loads_total"] == 3 and loads["copy_seconds_total"] > 0 and loads["receive_seconds_total"] == 0, loads


def shm_manager() -> int:
    """The pid of this process's ``torch_shm_manager`` (torch starts it with the first shared storage)."""
    children = [int(c) for task in Path("/proc/self/task").iterdir() for c in (task / "children").read_text().split()]
    (pid,) = [c for c in children if Path(f"/proc/{c}/comm").read_text().strip() == "torch_shm_manag"]  # 15 chars
    return pid


def test_a_shared_bucket_loads_when_the_senders_shm_manager_answers_late(engine, tiny_model):
    """Opening the bucket registers it with the sender's shm manager, whose answer libshm awaits 1 s;
    on a loaded machine (the suite on 2 cores) it once came later and the update failed. The engine asks
    again: here the manager is stopped for 2.5 s, so the first two tries time out."""
    shape = checkpoint_tensors(tiny_model("qwen2"))[NAME].shape
    payload = payload_of(packed([(NAME, torch.full(shape, 5.0))]))
    manager = shm_manager()
    resume = threading.Timer(2.5, os.kill, (manager, signal.SIGCONT))
    post(engine, "/begin_weight_update", {})
    os.kill(manager, signal.SIGSTOP)
    resume.start()
    try:
        response = post(
            engine,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [payload], "load_format": "flattened_bucket"},
        )
    finally:
        resume.join()
    assert response.status_code == 200, response.text
    assert torch.tensor(state(engine)[0]).unique().tolist() == [5.0]
    post(engine, "/end_weight_update", {})


def test_a_distributed_update_over_gloo_and_a_refused_one_still_takes_its_broadcast(engine, tiny_model):
    good = checkpoint_tensors(tiny_model("qwen2", seed=5))
    port, joined = free_port(), {}
    thread = threading.Thread(
        target=lambda: joined.setdefault("g", join_update_group("127.0.0.1", port, 2, 0, timeout=60))
    )
    thread.start()
    init = post(
        engine,
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
    )
    thread.join()
    assert init.json() == {"success": True, "message": "Succeeded to initialize custom process group."}
    group = joined["g"]

    def update(named, **extra) -> httpx.Response:
        bucket = packed(named, shared=False)
        sender = threading.Thread(target=group.broadcast, args=(bucket.flat,))
        sender.start()
        response = post(
            engine,
            "/update_weights_from_distributed",
            {
                "names": bucket.names,
                "dtypes": [dtype_name(m.dtype) for m in bucket.metadata],
                "shapes": [list(m.shape) for m in bucket.metadata],
                "load_format": "flattened_bucket",
                "flush_cache": False,
                **extra,
            },
        )
        sender.join(30)
        assert not sender.is_alive(), "the broadcast must complete even when the update is refused"
        return response

    before = state(engine)
    post(engine, "/begin_weight_update", {})
    refused = update([("no.such.weight", good[NAME])], weight_version="bad")
    assert refused.status_code == 400 and "unknown parameter names" in refused.json()["message"]
    assert state(engine)[0] == before[0]
    ok = update([(NAME, good[NAME]), ("model.norm.weight", good["model.norm.weight"])], weight_version="d1")
    assert ok.status_code == 200, ok.text
    loads = weight_load_metrics(engine)
    assert loads["loads_total"] == 1 and loads["receive_seconds_total"] > 0 and loads["copy_seconds_total"] > 0, loads
    post(engine, "/end_weight_update", {})
    assert state(engine) == (good[NAME][:2].tolist(), "d1")
    assert post(engine, "/destroy_weights_update_group", {"group_name": "weight_update_group"}).json()["success"]
    assert post(engine, "/destroy_weights_update_group", {"group_name": "weight_update_group"}).status_code == 400
    group.close()


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_requests_in_flight_abort_or_resume_and_each_token_has_one_version(engine, tiny_model, mode):
    new = checkpoint_tensors(tiny_model("qwen2", seed=5))
    sync = WeightSync(TensorTransport(torch.device("cpu")), [engine], buffer_size=1 << 20, pause_mode=mode)
    async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
        # Long enough to be running when the pause comes on a loaded machine too: 600 tokens (0.46 s
        # alone) once ended first in CI; 3,000 take 2 s alone.
        body = {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": IN_FLIGHT_TOKENS}}
        inflight = await started(client, body, min_tokens=20)
        report = await sync.update(new.items(), "step-1")
        out = await asyncio.wait_for(inflight, 120)
        after = (
            await client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3}})
        ).json()
    assert report.buckets >= 1 and set(report.seconds) >= {"pause", "begin", "buckets", "end", "continue"}
    assert report.flushed == (0 if mode == "in_place" else 1)  # in_place keeps the KV: no flush is asked for
    meta = out["meta_info"]
    if mode == "abort":
        assert meta["finish_reason"]["type"] == "abort" and 20 <= len(out["output_ids"]) < IN_FLIGHT_TOKENS
        # As SGLang reports a finished request, an aborted one too: one span, every token the old weights'
        assert meta["weight_version"] == "default"
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(out["output_ids"])}]
    else:
        assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == IN_FLIGHT_TOKENS
        spans = meta["weight_versions"]
        assert [s["version"] for s in spans] == ["default", "step-1"]
        assert (
            spans[0]["start"] == 0
            and spans[0]["end"] == spans[1]["start"] >= 20
            and spans[1]["end"] == IN_FLIGHT_TOKENS
        )
    assert after["meta_info"]["weight_version"] == "step-1"


async def test_retracted_requests_sample_their_new_tokens_from_the_new_weights_alone(procs, tiny_model):
    """What the trainer's fresh-token gap rests on in an async job: after a retract across an update, every
    token stamped with the new version has the log-prob the new weights give its whole sequence (no KV and
    no routing kept from the old weights), and the routes returned are the new weights' (a MoE model). A
    GRPO group's samples share their prompt's KV: the retract, re-prefill and sharing must not mix them."""
    url = procs.engine(tiny_model("qwen3_moe"), "--enable-return-routed-experts").url
    new_model = tiny_model("qwen3_moe", seed=5)
    tokens_each = 1500  # a group started together is still running after 20 tokens (600 once ended first in CI)
    sync = WeightSync(TensorTransport(torch.device("cpu")), [url], buffer_size=1 << 20, pause_mode="retract")
    prompt = list(range(40, 90))

    def body(seed: int) -> dict:
        return {
            "input_ids": prompt,
            "return_logprob": True,
            "return_routed_experts": True,
            "sampling_params": {
                "max_new_tokens": tokens_each,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": seed,
            },
        }

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        group = await asyncio.gather(*(started(client, body(seed), min_tokens=20) for seed in range(4)))
        await sync.update(checkpoint_tensors(new_model).items(), "step-1")
        outs = await asyncio.wait_for(asyncio.gather(*group), 120)
    model = AutoModelForCausalLM.from_pretrained(new_model, dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(new_model)
    for out in outs:
        meta = out["meta_info"]
        old, new = meta["weight_versions"]
        assert (old["version"], new["version"]) == ("default", "step-1") and new["end"] == tokens_each
        tokens = prompt + out["output_ids"]
        with torch.no_grad():  # every token but the last sampled one went through the model
            ran = model(torch.tensor([tokens[:-1]]), output_router_logits=True)
        reference = torch.log_softmax(ran.logits[0].float(), dim=-1)
        recorded = [lp for lp, _, _ in meta["output_token_logprobs"]]
        positions = range(len(prompt) + new["start"], len(tokens))
        gaps = [abs(recorded[p - len(prompt)] - reference[p - 1, tokens[p]].item()) for p in positions]
        assert max(gaps) <= 1e-4, f"new-version tokens off the new weights by up to {max(gaps):.3g}"
        got = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
        expected = torch.stack([r.topk(config.num_experts_per_tok, dim=-1).indices for r in ran.router_logits], 1)
        assert np.array_equal(got.reshape(expected.shape), expected.numpy())


async def test_a_failed_update_leaves_the_engine_serving_and_out_of_the_session(engine, tiny_model):
    weights = dict(checkpoint_tensors(tiny_model("qwen2", seed=5)))
    weights["model.norm.weight"] = torch.ones(65)  # the trainer's bug: a wrong shape
    sync = WeightSync(TensorTransport(torch.device("cpu")), [engine], buffer_size=1 << 20, pause_mode="abort")
    with pytest.raises(ProtocolError, match="expected shape"):
        await sync.update(weights.items(), "broken")
    async with httpx.AsyncClient(base_url=engine, timeout=60) as client:
        out = (
            await client.post(
                "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            )
        ).json()
        assert out["meta_info"]["weight_version"] == "default" and len(out["output_ids"]) == 3  # not paused, not bumped
        assert (await client.post("/begin_weight_update", json={})).status_code == 200  # the session was ended
        await client.post("/end_weight_update", json={})


@pytest.mark.parametrize("transport", ["tensor", "disk"])
async def test_buckets_are_packed_on_a_worker_thread_only_where_that_pays_on_a_cpu(
    engine, tiny_model, tmp_path, transport
):
    """A worker thread's copies would open a second OpenMP pool: the tensor transport packs inline on a CPU,
    the disk transport (its writes run outside OpenMP) keeps packing the next bucket while one is written.
    The first bucket, with no write beside it, is packed inline by both."""
    packing_threads = []

    def weights():
        for item in checkpoint_tensors(tiny_model("qwen2", seed=5)).items():
            packing_threads.append(threading.current_thread())
            yield item

    made = (
        TensorTransport(torch.device("cpu"))
        if transport == "tensor"
        else DiskTransport(torch.device("cpu"), str(tmp_path / "updates"), str(tiny_model("qwen2")))
    )
    report = await WeightSync(made, [engine], buffer_size=1 << 16, pause_mode="in_place").update(weights(), "step-1")
    assert report.buckets > 1
    assert packing_threads[0] is threading.main_thread()
    if transport == "tensor":
        assert set(packing_threads) == {threading.main_thread()}
    else:
        assert threading.main_thread() not in packing_threads[-3:]


def test_a_session_whose_trainer_died_is_ended_and_generation_resumes(procs, tiny_model):
    url = procs.engine(tiny_model("qwen2"), "--weight-update-timeout", "2").url
    assert post(url, "/begin_weight_update", {}).status_code == 200  # ... and the trainer never comes back
    started = time.monotonic()
    out = httpx.post(
        url + "/generate",
        timeout=60,
        json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
    ).json()
    assert len(out["output_ids"]) == 2 and 1.5 <= time.monotonic() - started < 30  # held, then released
    assert "inverted:weight_update_sessions_expired_total 1" in httpx.get(url + "/metrics").text
    assert post(url, "/end_weight_update", {}).status_code == 400  # already ended


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, module_procs, tiny_model):
    """The embedded engine, then real SGLang (the reference), each started once for the module."""
    return module_procs.server(request.param, tiny_model("qwen2")).url


@pytest.mark.parametrize("transport", ["tensor", "disk"])
async def test_the_trainers_weight_sync_loads_every_weight_exactly(server, tiny_model, tmp_path, transport):
    """The trainer's own sync (pause, session, several flattened buckets or safetensors shards, version,
    flush, continue) into each engine; then the served log-probs are ``transformers``' of the new weights."""
    from tests.engine.test_numerics import hf_logprobs

    seed = {"tensor": 5, "disk": 6}[transport]
    made = (
        TensorTransport(torch.device("cpu"))
        if transport == "tensor"
        else DiskTransport(torch.device("cpu"), str(tmp_path / "updates"), str(tiny_model("qwen2")))
    )
    weights = checkpoint_tensors(tiny_model("qwen2", seed=seed)).items()
    report = await WeightSync(made, [server], buffer_size=1 << 16, pause_mode="retract").update(weights, f"w{seed}")
    assert report.buckets > 1
    prompt = [5, 17, 300, 42]
    out = httpx.post(
        server + "/generate",
        timeout=60,
        json={
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    assert out["meta_info"]["weight_version"] == f"w{seed}"
    ref = hf_logprobs(tiny_model("qwen2", seed=seed), prompt + out["output_ids"])
    tokens = prompt + out["output_ids"]
    expected = [ref[p, tokens[p + 1]].item() for p in range(len(prompt) - 1, len(tokens) - 1)]
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-4
    assert out["output_ids"] == [int(ref[p].argmax()) for p in range(len(prompt) - 1, len(tokens) - 1)]
