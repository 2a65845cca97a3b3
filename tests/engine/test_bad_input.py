"""Bad input gets SGLang's 400 bodies, and the engine keeps serving everyone else."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import BACKENDS
from tests.engine.test_control import started

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, module_procs, tiny_model):
    """The embedded engine, then real SGLang (the reference), each started once for the module."""
    return module_procs.server(request.param, tiny_model("qwen2"), "--context-length", "256").url


@pytest.fixture(scope="module")
def embedded(module_procs, tiny_model):
    return module_procs.engine(tiny_model("qwen2"), "--context-length", "256").url


# A sampling parameter of the wrong type: SGLang's serde answers {"error": "<text>"}.
SCHEMA_ERRORS = [
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "temprature": 0.5}},  # unknown key (typo)
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}},  # string for int
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4.0}},  # JSON float for int
    {"input_ids": [1, 2], "sampling_params": {"ignore_eos": "yes"}},
]

# A request-level field of the wrong type: SGLang's pydantic validation, {"object": "error", "message": ...}.
FIELD_ERRORS = [
    {"input_ids": [1, "2"]},
    {"input_ids": [1, 2], "sampling_params": [1, 2]},
    {"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [5, "x"]},
]

# Values out of range, with real SGLang 0.5.23's own words.
VALUE_ERRORS = [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0, got -1."),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
    (
        {"input_ids": [1, 2], "sampling_params": {"temperature": -0.1}},
        "temperature must be a non-negative finite number, got -0.1.",
    ),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1, got 0."),
    (
        {"input_ids": list(range(200)), "sampling_params": {"max_new_tokens": 100}},
        "Requested token count exceeds the model's maximum context length of 256 tokens. You requested a total of 300 "
        "tokens: 200 tokens from the input messages and 100 tokens for the completion.",
    ),
    ({"input_ids": []}, "input_ids cannot be empty."),
    (
        {"input_ids": list(range(1, 257))},
        "The input (256 tokens) is longer than the model's context length (256 tokens).",
    ),
    # SGLang's scheduler takes a prompt of at most context - 7 tokens (hf_checkpoint.longest_prompt)
    ({"input_ids": list(range(1, 251))}, "Input length (250 tokens) exceeds the maximum allowed length (250 tokens)."),
    ({}, "Either text, input_ids or input_embeds should be provided."),
    (
        {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
        "The parallel_sample_num should be the same for all samples in sample params.",
    ),
    (
        {"input_ids": [1, 2], "token_ids_logprob": [5, 99999]},
        "token_ids_logprob contains out-of-vocabulary token id 99999; valid range is [0, 1280).",
    ),
    (
        {"input_ids": [1, 2], "lora_path": "nope"},
        "LoRA adapter 'nope' was requested, but LoRA is not enabled. Please launch the server with --enable-lora "
        "flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.",
    ),
    (
        {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 9},
        "req.logprob_start_len=9 is higher than the number of input tokens len(req.origin_input_ids)=2. "
        "Please use a smaller logprob_start_len.",
    ),
]

# Where the embedded engine refuses what real SGLang 0.5.23 does not (docs/sglang-differences.md): an empty text
# prompt, an id past the vocabulary and a logprob_start_len below -1 each kill the SGLang server; a per-prompt
# list shorter than the batch is its 500 (one longer is served, the rest ignored); repetition_penalty is SGLang's
# alone.
EMBEDDED_ONLY = [
    ({"text": ""}, "input_ids cannot be empty."),
    ({"input_ids": [1, 99999]}, "vocabulary size"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": -5}, "logprob_start_len must be"),
    ({"input_ids": [[1, 2], [3]], "return_logprob": [True]}, "return_logprob: expected 2 entries"),
    ({"input_ids": [[1, 2], [3]], "return_logprob": [True, True, True]}, "return_logprob: expected 2 entries"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}, "does not support"),
]


@pytest.mark.parametrize("body", SCHEMA_ERRORS)
def test_sampling_parameters_of_the_wrong_type_are_400_with_serdes_string(engine, body):
    response = httpx.post(engine + "/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert isinstance(response.json()["error"], str) and response.json()["error"]


def test_unknown_key_names_the_field(engine):
    error = httpx.post(engine + "/generate", json=SCHEMA_ERRORS[0], timeout=30).json()["error"]
    assert error.startswith("unknown field `temprature`, expected one of `max_new_tokens`")


@pytest.mark.parametrize("body", FIELD_ERRORS)
def test_request_fields_of_the_wrong_type_are_400_with_the_validation_body(engine, body):
    response = httpx.post(engine + "/generate", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400 and error["type"] == "Bad Request"
    assert error["message"].startswith(("1 validation error", "3 validation errors"))


@pytest.mark.parametrize(("body", "message"), VALUE_ERRORS)
def test_bad_values_are_400_with_sglangs_message(engine, body, message):
    response = httpx.post(engine + "/generate", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "message"), EMBEDDED_ONLY)
def test_what_the_embedded_engine_refuses_beyond_sglang(embedded, body, message):
    response = httpx.post(embedded + "/generate", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_text_beside_input_ids_generates_from_the_ids(engine):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    alone = httpx.post(engine + "/generate", json=body, timeout=30).json()
    both = httpx.post(engine + "/generate", json={**body, "text": "something else"}, timeout=30)
    assert both.status_code == 200 and both.json()["output_ids"] == alone["output_ids"]
    assert both.json()["meta_info"]["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("prompt", "max_new_tokens", "sampled"),
    [
        (200, None, 54),  # SGLang checks only a max_new_tokens the request set against the context
        (240, 16, 14),  # 256 in all fits the context, and is cut 2 short of it
        (249, 1000, None),  # set, and past the context: refused
        (249, 5, 5),  # the longest prompt served, and all it may sample
    ],
)
def test_new_tokens_stop_two_short_of_the_context(engine, prompt, max_new_tokens, sampled):
    """SGLang's scheduler serves at most context - 1 tokens and samples at most what that leaves less one
    (``hf_checkpoint.room_after``), saying ``length`` with the cut limit."""
    limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    body = {"input_ids": list(range(1, prompt + 1)), "sampling_params": {"temperature": 0, "ignore_eos": True, **limit}}
    response = httpx.post(engine + "/generate", json=body, timeout=60)
    if sampled is None:
        assert response.status_code == 400 and "exceeds the model's maximum context length" in response.text
        return
    assert response.status_code == 200, response.text
    out = response.json()
    assert len(out["output_ids"]) == sampled and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": sampled,
    }


def test_malformed_json_and_mistyped_control_bodies(engine):
    for path, content in (
        ("/generate", b'{"input_ids": [1,'),
        ("/pause_generation", b"not json"),
        ("/update_weight_version", b"{}"),
    ):
        response = httpx.post(engine + path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400, (path, response.text)
        body = response.json()
        assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
    response = httpx.post(engine + "/pause_generation", json={"mode": "sideways"})
    assert response.status_code == 400 and response.json()["object"] == "error"
    assert "validation error" in response.json()["message"] and "sideways" in response.json()["message"]


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"", "application/json"),  # no body
        (b"[1, 2]", "application/json"),  # JSON, not an object
        (b'{"input_ids": [1, 2]}', "text/plain"),  # FastAPI 0.165 reads JSON under a JSON content type only
        (b'{"input_ids": [1, 2]}', None),
    ],
)
def test_a_body_that_is_not_a_json_object_is_refused_with_the_validation_body(engine, content, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(engine + "/generate", content=content, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400 and "validation error" in error["message"]
    body = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}'
    for kind in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert httpx.post(engine + "/generate", content=body, headers={"content-type": kind}).status_code == 200


async def test_bad_requests_do_not_disturb_good_ones(engine):
    async with httpx.AsyncClient(base_url=engine, timeout=60) as client:
        # Hold the good request in flight (decoding, then paused in place) while bad ones arrive.
        good = await started(
            client,
            {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}, "rid": "good-one"},
        )
        await client.post("/pause_generation", json={"mode": "in_place"})
        # SGLang holds new requests while paused (the embedded engine answers the bad ones at once)
        bodies = [b for b, _ in VALUE_ERRORS] + SCHEMA_ERRORS + FIELD_ERRORS + [{"input_ids": [1], "rid": "good-one"}]
        bad = asyncio.gather(*(client.post("/generate", json=b) for b in bodies))
        await asyncio.sleep(0.5)
        assert not good.done()
        await client.post("/continue_generation", json={})
        answers = await asyncio.wait_for(bad, 60)
        result = await asyncio.wait_for(good, 60)
    assert [r.status_code for r in answers] == [400] * len(bodies)
    assert "Duplicate request ID" in answers[-1].json()["error"]["message"]
    assert len(result["output_ids"]) == 240 and result["meta_info"]["finish_reason"]["type"] == "length"
    assert httpx.get(engine + "/health").status_code == 200


def test_api_keys(procs, tiny_model):
    url = procs.engine(tiny_model("qwen2"), "--api-key", "user-key", "--admin-api-key", "admin-key").url
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.post(url + "/generate", json=body).status_code == 401
    assert httpx.post(url + "/generate", json=body, headers={"Authorization": "Bearer user-key"}).status_code == 200
    for key, status in ((None, 401), ("user-key", 401), ("admin-key", 200)):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert (
            httpx.post(url + "/update_weight_version", json={"new_version": "x"}, headers=headers).status_code == status
        )
    assert httpx.post(url + "/generate", json=body).json()["object"] == "error"


def test_a_torch_failure_inside_a_weight_load_is_our_500_not_the_clients_400(tiny_model, monkeypatch):
    """A weight load that passes every check and then fails in torch is a bug of the engine's (or
    its device's): 500 with the cause, never a 400 that blames the sender. The engine keeps serving."""
    from inverted.engine.config import EngineConfig
    from inverted.engine.model import CausalLM
    from inverted.engine.server import create_app
    from inverted.hf_checkpoint import checkpoint_tensors
    from tests.conftest import serving
    from tests.engine.test_weight_updates import packed, payload_of

    def fails(self, named, **_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with serving(create_app(EngineConfig(model=str(tiny_model("qwen2"))))) as url:
        monkeypatch.setattr(CausalLM, "load_weights", fails)  # once started: starting loads weights too
        response = httpx.post(
            url + "/update_weights_from_disk", json={"model_path": str(tiny_model("qwen2", seed=1))}, timeout=60
        )
        assert response.status_code == 500
        assert "RuntimeError: CUDA error" in response.json()["error"]["message"]
        # inside an update session too (this route used to answer any RuntimeError with a 400)
        named = list(checkpoint_tensors(str(tiny_model("qwen2", seed=1))).items())[:2]
        assert httpx.post(url + "/begin_weight_update", json={}).status_code == 200
        response = httpx.post(
            url + "/update_weights_from_tensor",
            timeout=60,
            json={"serialized_named_tensors": [payload_of(packed(named))], "load_format": "flattened_bucket"},
        )
        assert response.status_code == 500 and "CUDA error" in response.json()["error"]["message"]
        assert httpx.post(url + "/end_weight_update", json={}).status_code == 200
        generated = httpx.post(
            url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=60
        )
        assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2
