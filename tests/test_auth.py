"""API keys: one rule for every service, compared in constant time (``inverted.auth``)."""

from __future__ import annotations

import hmac

import httpx
import pytest
from starlette.requests import Request

from inverted import auth
from inverted.buffer.config import BufferConfig
from inverted.engine.config import EngineConfig
from inverted.rollout.proxy.config import ProxyConfig
from tests.conftest import serving


def request(**headers: str) -> Request:
    return Request(
        {
            "type": "http",
            "query_string": b"",
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
        }
    )


def test_the_rule_for_case_whitespace_and_schemes():
    assert auth.presented_key(request(authorization="Bearer  sk-1 ")) == "sk-1"
    assert auth.presented_key(request(authorization="bearer sk-1")) == "sk-1"
    assert auth.presented_key(request(x_api_key=" sk-2")) == "sk-2"  # Anthropic's SDK
    assert auth.presented_key(request(x_goog_api_key="sk-3")) is None  # Google's, on the proxy only
    assert auth.presented_key(request(x_goog_api_key="sk-3"), google=True) == "sk-3"
    assert auth.presented_key(request(authorization="Basic c2s6MQ==")) is None
    assert auth.presented_key(request()) is None
    assert auth.key_matches("sk-1", "sk-1") and not auth.key_matches("sk-1", "sk-2")
    assert not auth.key_matches(None, "sk-1") and not auth.key_matches("", "") and not auth.key_matches("sk", None)


@pytest.fixture
def compared(monkeypatch) -> list[tuple[bytes, bytes]]:
    """Every comparison ``hmac.compare_digest`` makes while the test runs."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    return calls


def test_the_engine_compares_keys_through_the_shared_rule(tiny_model, compared):
    from inverted.engine.server import create_app

    config = EngineConfig(model=str(tiny_model("qwen2")), api_key="user-key-0", admin_api_key="admin-key-0")
    with serving(create_app(config)) as url:
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer user-key-1"}).status_code == 401
        assert (b"user-key-1", b"user-key-0") in compared
        assert httpx.get(url + "/v1/models", headers={"Authorization": "bearer  user-key-0"}).status_code == 200
        assert httpx.post(url + "/flush_cache", headers={"Authorization": "Bearer user-key-0"}).status_code == 401
        assert (b"user-key-0", b"admin-key-0") in compared
        assert httpx.post(url + "/flush_cache", headers={"Authorization": "Bearer admin-key-0"}).status_code == 200


def test_the_proxy_compares_keys_through_the_shared_rule(tiny_model, compared):
    from inverted.rollout.proxy.service import create_app

    config = ProxyConfig(
        router_url="http://127.0.0.1:9", tokenizer=str(tiny_model("qwen2")), proxy_api_key="proxy-key-0"
    )
    with serving(create_app(config)) as url:
        assert (
            httpx.post(url + "/sessions", json={}, headers={"Authorization": "Bearer proxy-key-1"}).status_code == 401
        )
        assert (b"proxy-key-1", b"proxy-key-0") in compared
        session = httpx.post(url + "/sessions", json={}, headers={"Authorization": "Bearer proxy-key-0"}).json()
        compared.clear()
        samples = httpx.get(
            f"{url}/sessions/{session['session_id']}/samples", headers={"Authorization": f"Bearer {session['token']}"}
        )
        assert samples.status_code == 200
        assert (session["token"].encode(), session["token"].encode()) in compared


def test_the_buffer_compares_keys_through_the_shared_rule(tmp_path, compared):
    from inverted.buffer.service import create_app

    with serving(create_app(BufferConfig(db=str(tmp_path / "buffer.db"), api_key="buffer-key-0"))) as url:
        assert httpx.get(url + "/stats", headers={"Authorization": "Bearer buffer-key-1"}).status_code == 401
        assert (b"buffer-key-1", b"buffer-key-0") in compared
        assert httpx.get(url + "/stats", headers={"Authorization": "Bearer buffer-key-0"}).status_code == 200
