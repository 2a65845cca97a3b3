"""The SGLang client's error paths, against a real loopback server made to misbehave on purpose.

(Its happy paths run against real engines and the real router in the other rollout tests.)
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from inverted.errors import ProtocolError, ServiceUnavailable
from inverted.processes import free_port
from inverted.rollout.sglang_client import SGLangClient, Timeouts

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def engine(handler, **kwargs):
    """An ``SGLangClient`` for a server on loopback whose every answer is ``handler(request, n)``,
    n counting the requests; and the list of (path, headers, body) the server saw."""
    seen: list[tuple[str, dict[str, str], bytes]] = []

    async def route(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, dict(request.headers), await request.read()))
        return await handler(request, len(seen))

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", route)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = "http://127.0.0.1:%d" % runner.addresses[0][1]
    try:
        async with SGLangClient(url, **kwargs) as client:
            yield client, seen
    finally:
        await runner.cleanup()


def answer(status: int, body=None, text: str | None = None):
    async def handler(request, n):
        return web.Response(status=status, text=text) if text is not None else web.json_response(body, status=status)

    return handler


async def test_503_then_success_is_retried():
    async def handler(request, n):
        if n < 3:
            return web.Response(status=503, text="busy")
        return web.json_response({"text": "ok", "output_ids": [1], "meta_info": {}})

    async with engine(handler) as (client, seen):
        assert (await client.generate({"input_ids": [1]}))["text"] == "ok"
    assert [path for path, _, _ in seen] == ["/generate"] * 3


async def test_4xx_is_never_retried_and_carries_the_body():
    async with engine(answer(400, {"error": {"message": "max_new_tokens must be at least 0"}})) as (client, seen):
        with pytest.raises(ProtocolError) as info:
            await client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})
        assert len(seen) == 1
        assert info.value.status == 400 and "max_new_tokens" in info.value.body
        assert info.value.url == client.base_url + "/generate"


async def test_persistent_5xx_and_connection_errors_become_service_unavailable():
    async with engine(answer(502, text="bad gateway"), max_attempts=3) as (client, seen):
        with pytest.raises(ServiceUnavailable) as info:
            await client.pause_generation()
        assert len(seen) == 3 and info.value.status == 502

    async with SGLangClient(f"http://127.0.0.1:{free_port()}", max_attempts=2) as nobody:  # nothing listens there
        with pytest.raises(ServiceUnavailable, match="Connect"):
            await nobody.generate({"input_ids": [1]})
        assert await nobody.health() is False  # a probe answers, it does not raise


async def test_health_probes_read_the_status():
    async with engine(answer(200, {})) as (client, seen):
        assert await client.health() is True and await client.ready() is True
    assert [path for path, _, _ in seen] == ["/health", "/ready"]
    async with engine(answer(503, text="starting")) as (client, seen):
        assert await client.health() is False
    assert len(seen) == 1  # one try: a probe is not retried


async def test_metrics_read_prometheus_text_as_real_sglang_writes_it():
    text = (
        "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n"
        'sglang:num_running_reqs{model_name="qwen, tiny",tp_rank="0"} 3.0\n\ninverted:weight_loads_total 7\n'
    )
    async with engine(answer(200, text=text)) as (client, _):
        assert await client.metrics() == {
            'sglang:num_running_reqs{model_name="qwen, tiny",tp_rank="0"}': 3.0,
            "inverted:weight_loads_total": 7.0,
        }


async def _too_slow(request, n):
    await asyncio.sleep(3.0)
    return web.json_response({})


async def _hang_up(request, n):
    request.transport.close()  # the connection drops after the request was sent
    return web.json_response({})


@pytest.mark.parametrize("misbehave", [_too_slow, _hang_up], ids=["read timeout", "connection lost"])
async def test_unknown_outcomes_retry_only_idempotent_calls(misbehave):
    # The timeouts also bound getting a connection: generous enough that a busy CI machine still connects.
    async with engine(misbehave, max_attempts=3, timeouts=Timeouts(control=0.5, generate=0.5)) as (client, seen):
        with pytest.raises(ServiceUnavailable):
            await client.generate({"input_ids": [1]})
        assert len(seen) == 1  # generating twice would waste a rollout: not retried
        with pytest.raises(ServiceUnavailable):
            await client.continue_generation()
        assert len(seen) == 4


async def test_malformed_bodies_and_failed_updates_are_protocol_errors():
    async with engine(answer(200, text="<html>")) as (client, _):
        with pytest.raises(ProtocolError, match="expected a JSON body"):
            await client.model_info()
    async with engine(answer(400, {"success": False, "message": "bad shape"})) as (client, _):
        with pytest.raises(ProtocolError) as info:
            await client.update_weights_from_disk("/ckpt")
        assert "bad shape" in info.value.body and "bad shape" in str(info.value)
    async with engine(answer(400, text="Cache not flushed")) as (client, _):
        assert await client.flush_cache() is False


async def test_api_key_is_sent_and_bodies_are_sglang_shaped():
    reply = {"success": True, "message": "m", "new_version": "v3"}
    async with engine(answer(200, reply), api_key="secret") as (client, seen):
        assert await client.update_weight_version("v3", abort_all_requests=False) == "v3"
    _, headers, body = seen[0]
    assert headers["Authorization"] == "Bearer secret"
    assert json.loads(body) == {"new_version": "v3", "abort_all_requests": False}


async def test_a_stream_line_longer_than_any_read_buffer_arrives_whole():
    chunk = {"text": "x" * 300_000, "output_ids": list(range(20_000)), "meta_info": {}}

    async def stream(request, n):
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async with engine(stream) as (client, _):
        assert [c async for c in client.generate_stream({"input_ids": [1]})] == [chunk]
    async with engine(answer(503, text="paused")) as (client, _):
        with pytest.raises(ServiceUnavailable) as info:
            [c async for c in client.generate_stream({"input_ids": [1]})]
        assert info.value.status == 503 and info.value.body == "paused"
