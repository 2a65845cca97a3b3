"""Hostile input against each service: never a 5xx, always the API's own error shape, ``/health``
within a second afterwards, and nothing stored changed by a refused request.

Generated bodies come from Hypothesis (any JSON value, as a whole body and as the value of each
field a route reads); the classic attacks are listed by hand.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.adversarial.conftest import ADMIN_KEY, BUFFER_KEY, PROXY_KEY, health_latency

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# Hypothesis's floats include NaN and infinities, which json.dumps writes as NaN/Infinity: not JSON,
# and exactly what a careless client sends.
GENERATED = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CLASSIC = [
    b"",
    b"{",
    b'{"a": ',
    b"[" * 100_000,
    b"{" * 100_000,
    b'{"x": 1e999999}',
    b"NaN",
    b'"\xff\xfe"',
    b"\xff\xfe\xfd",
    b'{"messages": "' + b"\\ud800" * 10 + b'"}',
    json.dumps({"a" * 10_000: 1}).encode(),
    b"[]",
    b"null",
    b"12",
    json.dumps({"max_tokens": 10**400}).encode(),
    json.dumps({"unknown_field": True, "another": [1, 2]}).encode(),
]


def engine_shape(body) -> bool:
    if isinstance(body, dict) and set(body) == {"object", "message", "type", "param", "code"}:
        return True  # SGLang's validation shape
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and (isinstance(body["error"], str) or set(body["error"]) == {"message"})
    )


def openai_shape(body) -> bool:
    return (
        isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    )


def buffer_shape(body) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and set(body["error"]) >= {"message", "type", "code"}


def refused(response: httpx.Response, shape) -> None:
    """A client error in the service's shape, and the service still answering."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert shape(response.json()), response.text[:300]


def targets(services, session: dict):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return [
        (services.engine.url + "/generate", {}, engine_shape),
        (services.engine.url + "/update_weights_from_tensor", admin, engine_shape),
        (services.engine.url + "/update_weight_version", admin, engine_shape),
        (session["base_url"] + "/chat/completions", {}, openai_shape),
        (session["base_url"] + "/completions", {}, openai_shape),
        (services.buffer.url + "/samples", {"Authorization": f"Bearer {BUFFER_KEY}"}, buffer_shape),
        (services.buffer.url + "/batches/next", {"Authorization": f"Bearer {BUFFER_KEY}"}, buffer_shape),
    ]


@pytest.fixture(scope="module")
def session(services) -> dict:
    return httpx.post(
        services.proxy.url + "/sessions", json={}, headers={"Authorization": f"Bearer {PROXY_KEY}"}
    ).json()


def buffer_state(services) -> dict:
    stats = httpx.get(services.buffer.url + "/stats", headers={"Authorization": f"Bearer {BUFFER_KEY}"}).json()
    return {k: v for k, v in stats.items() if k != "uptime_s"}


def test_the_classic_attacks_are_refused_in_each_api_s_shape(services, session):
    before = buffer_state(services)
    for url, headers, shape in targets(services, session):
        for body in CLASSIC:
            response = httpx.post(
                url, content=body, headers={**headers, "content-type": "application/json"}, timeout=30
            )
            refused(response, shape)
    for proc in (services.engine, services.proxy, services.buffer):
        assert health_latency(proc.url) < 1.0
    assert buffer_state(services) == before


@GENERATED
@given(body=JSON)
def test_any_json_body_is_answered_without_a_server_error(services, session, body):
    for url, headers, shape in targets(services, session):
        response = httpx.post(
            url, content=json.dumps(body), headers={**headers, "content-type": "application/json"}, timeout=30
        )
        if response.status_code >= 400:
            refused(response, shape)


@GENERATED
@given(
    value=JSON,
    field=st.sampled_from(
        [
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "tools",
            "tool_choice",
            "logprobs",
            "top_logprobs",
            "stream",
            "seed",
            "model",
        ]
    ),
)
def test_any_value_of_a_chat_field_is_a_400_in_openai_s_shape(services, session, value, field):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    response = httpx.post(
        session["base_url"] + "/chat/completions",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    if response.status_code >= 400:
        refused(response, openai_shape)


@GENERATED
@given(
    value=JSON,
    field=st.sampled_from(
        [
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "n",
            "ignore_eos",
            "sampling_seed",
            "min_new_tokens",
        ]
    ),
)
def test_any_value_of_a_sampling_parameter_is_a_400_in_sglang_s_shape(services, value, field):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, field: value}}
    response = httpx.post(
        services.engine.url + "/generate",
        content=json.dumps(body),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    if response.status_code >= 400:
        refused(response, engine_shape)


@GENERATED
@given(value=JSON, field=st.sampled_from(["lease_id", "sample"]))
def test_any_submission_is_refused_whole_and_changes_nothing(services, value, field):
    before = buffer_state(services)
    item = {"lease_id": "nope", "sample": {"group_index": 0, "index": 0}, field: value}
    response = httpx.post(
        services.buffer.url + "/samples",
        content=json.dumps({"samples": [item]}),
        headers={"Authorization": f"Bearer {BUFFER_KEY}", "content-type": "application/json"},
        timeout=30,
    )
    refused(response, buffer_shape)
    assert buffer_state(services) == before


def test_wrong_keys_and_other_sessions_tokens_are_refused(services, session):
    other = httpx.post(
        services.proxy.url + "/sessions", json={}, headers={"Authorization": f"Bearer {PROXY_KEY}"}
    ).json()
    for url, headers, status in [
        (services.engine.url + "/flush_cache", {"Authorization": "Bearer admin-kez"}, 401),
        (services.engine.url + "/flush_cache", {}, 401),
        (services.proxy.url + "/sessions", {"Authorization": "Bearer proxy-kez"}, 401),
        (
            f"{services.proxy.url}/sessions/{session['session_id']}/samples",
            {"Authorization": f"Bearer {other['token']}"},
            403,
        ),
        (
            f"{services.proxy.url}/sessions/{session['session_id']}/finish",
            {"Authorization": f"Bearer {other['token']}"},
            403,
        ),
        (services.buffer.url + "/stats", {"Authorization": "Bearer buffer-kez"}, 401),
        (services.buffer.url + "/stats", {"x-api-key": "buffer-kez"}, 401),
    ]:
        method = httpx.get if url.endswith(("/stats", "/samples")) else httpx.post
        assert method(url, headers=headers).status_code == status, url


def test_no_service_serves_its_api_map(services):
    """The audit found /docs and /openapi.json open on all three services, without a key."""
    for service in (services.engine, services.proxy, services.buffer):
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(service.url + path).status_code == 404, (service.name, path)


def test_slow_clients_holding_connections_do_not_starve_health(services):
    """64 connections that send half a request and hold it for 3 s (slowloris, bounded)."""
    for proc in (services.engine, services.proxy, services.buffer):
        parts = urlsplit(proc.url)
        held = []
        for _ in range(64):
            sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
            sock.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"te')
            held.append(sock)
        try:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                assert health_latency(proc.url) < 1.0, proc.name
                time.sleep(0.2)
        finally:
            for sock in held:
                sock.close()


LONE = "\ud800"  # a UTF-16 surrogate without its pair: valid JSON escape, not Unicode text


def post_raw(url: str, body, headers: dict | None = None) -> httpx.Response:
    """``body`` as json.dumps writes it (escaping the surrogate), which httpx's own encoder cannot."""
    return httpx.post(
        url, content=json.dumps(body), headers={"content-type": "application/json", **(headers or {})}, timeout=10
    )


def test_lone_surrogates_and_deep_nesting_are_400s_naming_the_field_and_lose_nothing(services):
    """The audit: each was a 500, and a surrogate in a message's name let the call through and lost
    its session's Sample (every later /finish answered 500)."""
    for body, field in (({"text": f"hi {LONE}"}, "text"), ({"text": "hi", "rid": LONE}, "rid")):
        response = post_raw(services.engine.url + "/generate", body)
        refused(response, engine_shape)
        assert f"{field} is not valid Unicode text" in response.text, response.text
    admin = {"Authorization": f"Bearer {PROXY_KEY}"}
    session = httpx.post(services.proxy.url + "/sessions", json={}, headers=admin).json()
    calls = {
        "/chat/completions": (
            {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
            "messages[0].name",
        ),
        "/responses": (
            {"model": "m", "max_output_tokens": 2, "input": [{"role": "user", "content": f"hi {LONE}"}]},
            "input[0].content",
        ),
        "/messages": (
            {
                "model": "m",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}],
            },
            "messages[0].content[0].text",
        ),
    }
    for route, (body, field) in calls.items():
        response = post_raw(session["base_url"] + route, body)
        refused(response, openai_shape if route != "/messages" else (lambda b: b["type"] == "error"))
        assert f"{field} is not valid Unicode text" in response.text, (route, response.text)
    fine = httpx.post(
        session["base_url"] + "/chat/completions",
        timeout=30,
        json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert fine.status_code == 200
    finished = httpx.post(f"{services.proxy.url}/sessions/{session['session_id']}/finish", headers=admin)
    assert finished.status_code == 200 and len(finished.json()["samples"]) == 1, finished.text[:300]
    # 100k levels of nesting in a Sample's metadata, in the buffer's /samples: a 400, nothing stored.
    before = buffer_state(services)
    deep = b'{"samples": [{"lease_id": "x", "sample": {"metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}]}"
    response = httpx.post(
        services.buffer.url + "/samples",
        content=deep,
        timeout=10,
        headers={"Authorization": f"Bearer {BUFFER_KEY}", "content-type": "application/json"},
    )
    refused(response, buffer_shape)
    assert "nested too deeply" in response.text and buffer_state(services) == before
    for service in (services.engine, services.proxy, services.buffer):
        assert health_latency(service.url) < 1.0
