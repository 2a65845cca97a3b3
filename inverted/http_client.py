"""The retrying async HTTP base that every client module builds on (shared; imports only ``errors``).

One ``httpx.AsyncClient`` per service, ``trust_env=False`` (traffic stays inside the cluster),
explicit timeouts per call kind, and one retry policy: connection errors, 502/503/504, and
timeouts of idempotent calls are retried with jittered exponential backoff, each attempt logged
at WARNING with the URL; a 4xx is never retried. Exhausted retries raise ``ServiceUnavailable``;
a 4xx or a body of the wrong shape raises ``ProtocolError``; both carry URL, status and body.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_random_exponential

from inverted.errors import ProtocolError, ServiceUnavailable

logger = logging.getLogger(__name__)

RETRY_STATUS = {502, 503, 504}


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds per call kind; never unbounded."""

    connect: float = 5.0
    health: float = 5.0
    control: float = 60.0
    generate: float = 1800.0
    weights: float = 600.0
    data: float = 120.0  # buffer submissions and leases


class _Retryable(Exception):
    """Internal: an attempt failed in a way worth another try."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class HTTPService:
    """One ``httpx.AsyncClient`` per service, with the retry policy above."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeouts: Timeouts = Timeouts(),
                 max_attempts: int = 4, max_connections: int = 256, transport: httpx.AsyncBaseTransport | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self.max_attempts = max_attempts
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, trust_env=False, transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _timeout(self, seconds: float) -> httpx.Timeout:
        return httpx.Timeout(seconds, connect=self.timeouts.connect)

    async def request(self, method: str, path: str, *, json_body: Any = None, content: bytes | None = None,
                      timeout: float, idempotent: bool, params: dict | None = None) -> httpx.Response:
        """Send with retries; return a 2xx response or raise ProtocolError / ServiceUnavailable."""
        url = self.base_url + path

        async def attempt() -> httpx.Response:
            try:
                headers = {"content-type": "application/json"} if content is not None else None
                response = await self._http.request(method, path, json=json_body, content=content, headers=headers,
                                                    params=params, timeout=self._timeout(timeout))
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                raise _Retryable(exc) from exc  # the request never reached the server: always safe to resend
            except httpx.TransportError as exc:  # read/write failure or timeout: the outcome is unknown
                if idempotent:
                    raise _Retryable(exc) from exc
                raise ServiceUnavailable(f"{method} {path}: {type(exc).__name__} after sending (timeout {timeout}s); "
                                         "the outcome is unknown", url=url) from exc
            if response.status_code in RETRY_STATUS:
                raise _Retryable(ServiceUnavailable(f"{method} {path} failed", url=url,
                                                    status=response.status_code, body=response.text))
            if response.status_code >= 400:
                raise ProtocolError(f"{method} {path} was rejected", url=url, status=response.status_code, body=response.text)
            return response

        def log_retry(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            logger.warning("%s %s: attempt %d/%d failed (%s); retrying", method, url, state.attempt_number,
                           self.max_attempts, getattr(exc, "error", exc))

        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, _Retryable)), stop=stop_after_attempt(self.max_attempts),
            wait=wait_random_exponential(multiplier=0.2, max=5.0), before_sleep=log_retry, reraise=True,
        )
        try:
            async for step in retrying:
                with step:
                    return await attempt()
        except _Retryable as exc:
            error = exc.error
            if isinstance(error, ServiceUnavailable):
                raise error from None
            raise ServiceUnavailable(f"{method} {path}: {type(error).__name__}: {error}", url=url) from None
        raise AssertionError("unreachable")

    @staticmethod
    def json_of(response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise ProtocolError("expected a JSON body", url=str(response.request.url), status=response.status_code,
                                body=response.text) from None
