"""Bad input gets SGLang's 400 bodies, and the engine keeps serving everyone else."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def engine(module_procs, tiny_model):
    return module_procs.engine(tiny_model("qwen2"), "--context-length", "256").url


SCHEMA_ERRORS = [
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}},  # unknown key (typo)
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}},  # string for int
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4.0}},  # JSON float for int
    {"input_ids": [1, 2], "sampling_params": {"ignore_eos": "yes"}},
    {"input_ids": [1, "2"]},
    {"input_ids": [1, 2], "sampling_params": [1, 2]},
]

VALUE_ERRORS = [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.1}}, "temperature must be non-negative"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k must be -1"),
    ({"input_ids": list(range(200)), "sampling_params": {"max_new_tokens": 100}}, "maximum context length of 256"),
    ({"input_ids": []}, "input is empty"),
    ({"text": ""}, "input is empty"),
    ({}, "Either text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "Either text or input_ids"),
    ({"input_ids": [1, 99999]}, "vocabulary size"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "same n"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}, "does not support"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 9}, "logprob_start_len"),
]


@pytest.mark.parametrize("body", SCHEMA_ERRORS)
def test_contract_violations_are_400_with_a_string_error(engine, body):
    response = httpx.post(engine + "/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert isinstance(response.json()["error"], str) and response.json()["error"]


def test_unknown_key_names_the_field(engine):
    error = httpx.post(engine + "/generate", json=SCHEMA_ERRORS[0], timeout=30).json()["error"]
    assert error.startswith("unknown field `temprature`")


@pytest.mark.parametrize(("body", "message"), VALUE_ERRORS)
def test_bad_values_are_400_with_a_message(engine, body, message):
    response = httpx.post(engine + "/generate", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_malformed_json_and_mistyped_control_bodies(engine):
    for path, content in (("/generate", b'{"input_ids": [1,'), ("/pause_generation", b"not json"),
                          ("/update_weight_version", b"{}")):
        response = httpx.post(engine + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        body = response.json()
        assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
    response = httpx.post(engine + "/pause_generation", json={"mode": "sideways"})
    assert response.status_code == 400 and "mode must be one of" in response.json()["error"]["message"]


async def test_bad_requests_do_not_disturb_good_ones(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=60) as client:
        # Hold the good request in flight (paused in place) while bad ones arrive.
        await client.post("/pause_generation", json={"mode": "in_place"})
        good = asyncio.create_task(client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 60, "ignore_eos": True}, "rid": "good-one"}))
        while (await client.get("/get_load")).json()[0]["num_waiting_reqs"] == 0:
            await asyncio.sleep(0.05)
        bad = await asyncio.gather(*(client.post("/generate", json=b) for b, _ in VALUE_ERRORS),
                                   *(client.post("/generate", json=b) for b in SCHEMA_ERRORS))
        assert all(r.status_code == 400 for r in bad)
        dup = await client.post("/generate", json={"input_ids": [1], "rid": "good-one"})
        assert dup.status_code == 400 and "Duplicate request ID" in dup.json()["error"]["message"]
        await client.post("/continue_generation", json={})
        result = await good
    assert result.status_code == 200 and len(result.json()["output_ids"]) == 60
    assert httpx.get(engine + "/health").status_code == 200


def test_api_keys(procs, tiny_model):
    url = procs.engine(tiny_model("qwen2"), "--api-key", "user-key", "--admin-api-key", "admin-key").url
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/generate", json=body).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer user-key"}).status_code == 200
    for key, status in ((None, 401), ("user-key", 401), ("admin-key", 200)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.post(url + "/update_weight_version", json={"new_version": "x"}, headers=headers).status_code == status
    assert httpx.post(url + "/generate", json=body).json()["object"] == "error"


def test_a_torch_failure_inside_a_weight_load_is_our_500_not_the_clients_400(tiny_model, monkeypatch):
    """A weight load that passes every check and then fails in torch is a bug of the engine's (or
    its device's): 500 with the cause, never a 400 that blames the sender. The engine keeps serving."""
    from inverted.config import EngineConfig
    from inverted.engine.model import CausalLM
    from inverted.engine.server import create_app
    from inverted.hf_checkpoint import checkpoint_tensors
    from tests.conftest import serving
    from tests.engine.test_weight_updates import packed, payload_of

    def fails(self, named, **_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with serving(create_app(EngineConfig(model=str(tiny_model("qwen2"))))) as url:
        monkeypatch.setattr(CausalLM, "load_weights", fails)  # once started: starting loads weights too
        response = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_model("qwen2", seed=1))},
                              timeout=60)
        assert response.status_code == 500
        assert "RuntimeError: CUDA error" in response.json()["error"]["message"]
        # inside an update session too (this route used to answer any RuntimeError with a 400)
        named = list(checkpoint_tensors(str(tiny_model("qwen2", seed=1))).items())[:2]
        assert httpx.post(url + "/begin_weight_update", json={}).status_code == 200
        response = httpx.post(url + "/update_weights_from_tensor", timeout=60, json={
            "serialized_named_tensors": [payload_of(packed(named))], "load_format": "flattened_bucket"})
        assert response.status_code == 500 and "CUDA error" in response.json()["error"]["message"]
        assert httpx.post(url + "/end_weight_update", json={}).status_code == 200
        generated = httpx.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                               timeout=60)
        assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2
