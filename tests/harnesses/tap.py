"""A recording pass-through between a harness and the proxy: every request the harness's real
process sends (path, headers, JSON body) is kept, and forwarded unchanged, streamed answers included.

The requests it keeps are the other side's artifact the tests compare against: what the harness
sent, not what the proxy made of it.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.conftest import serving

HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


@contextmanager
def tap(upstream: str) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Yields (the tap's URL, the list it records each request into, with the status it was answered)."""
    seen: list[dict[str, Any]] = []
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0), trust_env=False)

    async def forward(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        seen.append(
            {
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.url.query, headers=headers, content=raw
        )
        answer = await client.send(upstream_request, stream=True)
        seen[-1]["status"] = answer.status_code
        kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP | {"content-encoding"}}
        return StreamingResponse(
            answer.aiter_raw(), status_code=answer.status_code, headers=kept, background=BackgroundTask(answer.aclose)
        )

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "HEAD"])])
    with serving(app) as url:
        yield url, seen
