"""The SGLang client's error paths, with ``httpx.MockTransport`` standing in for a misbehaving server.

(Its happy paths run against real engines and the real router in the other rollout tests.)
"""

from __future__ import annotations

import httpx
import pytest

from inverted.errors import ProtocolError, ServiceUnavailable
from inverted.rollout.sglang_client import SGLangClient, Timeouts

pytestmark = pytest.mark.anyio


def client_for(handler, **kwargs) -> tuple[SGLangClient, list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return handler(request, len(seen))

    return SGLangClient("http://engine", transport=httpx.MockTransport(record), **kwargs), seen


async def test_503_then_success_is_retried():
    client, seen = client_for(lambda req, n: httpx.Response(503, text="busy") if n < 3 else
                              httpx.Response(200, json={"text": "ok", "output_ids": [1], "meta_info": {}}))
    assert (await client.generate({"input_ids": [1]}))["text"] == "ok"
    assert len(seen) == 3
    assert all(r.url.path == "/generate" for r in seen)


async def test_4xx_is_never_retried_and_carries_the_body():
    client, seen = client_for(lambda req, n: httpx.Response(400, json={"error": {"message": "max_new_tokens must be at least 0"}}))
    with pytest.raises(ProtocolError) as info:
        await client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})
    assert len(seen) == 1
    assert info.value.status == 400 and "max_new_tokens" in info.value.body and info.value.url == "http://engine/generate"


async def test_persistent_5xx_and_connection_errors_become_service_unavailable():
    client, seen = client_for(lambda req, n: httpx.Response(502, text="bad gateway"), max_attempts=3)
    with pytest.raises(ServiceUnavailable) as info:
        await client.pause_generation()
    assert len(seen) == 3 and info.value.status == 502

    def refuse(req, n):
        raise httpx.ConnectError("connection refused", request=req)

    client, seen = client_for(refuse, max_attempts=2)
    with pytest.raises(ServiceUnavailable, match="ConnectError"):
        await client.generate({"input_ids": [1]})
    assert len(seen) == 2


@pytest.mark.parametrize("error", [httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError])
async def test_unknown_outcomes_retry_only_idempotent_calls(error):
    def slow(req, n):
        raise error("lost after sending", request=req)

    client, seen = client_for(slow, max_attempts=3, timeouts=Timeouts(control=0.1, generate=0.1))
    with pytest.raises(ServiceUnavailable):
        await client.generate({"input_ids": [1]})
    assert len(seen) == 1  # generating twice would waste a rollout: not retried
    client, seen = client_for(slow, max_attempts=3, timeouts=Timeouts(control=0.1))
    with pytest.raises(ServiceUnavailable):
        await client.continue_generation()
    assert len(seen) == 3


async def test_malformed_bodies_and_failed_updates_are_protocol_errors():
    client, _ = client_for(lambda req, n: httpx.Response(200, text="<html>"))
    with pytest.raises(ProtocolError, match="expected a JSON body"):
        await client.model_info()
    client, _ = client_for(lambda req, n: httpx.Response(400, json={"success": False, "message": "bad shape"}))
    with pytest.raises(ProtocolError) as info:
        await client.update_weights_from_disk("/ckpt")
    assert "bad shape" in info.value.body
    client, _ = client_for(lambda req, n: httpx.Response(400, text="Cache not flushed"))
    assert await client.flush_cache() is False


async def test_api_key_is_sent_and_bodies_are_sglang_shaped():
    client, seen = client_for(lambda req, n: httpx.Response(200, json={"success": True, "message": "m", "new_version": "v3"}),
                              api_key="secret")
    assert await client.update_weight_version("v3", abort_all_requests=False) == "v3"
    assert seen[0].headers["authorization"] == "Bearer secret"
    import json
    assert json.loads(seen[0].content) == {"new_version": "v3", "abort_all_requests": False}
