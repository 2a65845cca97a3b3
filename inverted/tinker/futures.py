"""Tinker's futures: every call answers a request id at once; the result is fetched by long-polling.

The SDK re-polls ``retrieve_future`` at once on ``try_again``, so a pending retrieve is held here up
to ``HOLD_S`` before it says so. A result is kept until ``KEEP_S`` after it is done (the SDK may
fetch it again after a dropped connection); a request id this process never issued, or one it
let go of, is unknown: the route answers 410 and the SDK resubmits the call, so a client that
outlives a server restart fails loudly or starts over, never reads another call's answer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

HOLD_S = 20.0
KEEP_S = 600.0


@dataclass(slots=True)
class Failure:
    """A call that failed: the SDK's category (``user``: the caller's input; ``server``: ours) and why."""

    message: str
    category: str = "user"


@dataclass(slots=True)
class Result:
    """A finished call: protobuf bytes (forward_backward, sample) or a JSON object; or a ``Failure``."""

    value: bytes | dict | Failure


class Futures:
    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[Result]] = {}
        self._owner: dict[str, str] = {}
        self._done_at: dict[str, float] = {}

    def create(self, owner: str) -> str:
        """A new request id (unguessable), its result to come; only ``owner`` (an API key) may read it."""
        self._forget_old()
        request_id = secrets.token_hex(12)
        self._pending[request_id] = asyncio.get_running_loop().create_future()
        self._owner[request_id] = owner
        return request_id

    def resolve(self, request_id: str, value: bytes | dict | Failure) -> None:
        future = self._pending.get(request_id)
        if future is not None and not future.done():
            future.set_result(Result(value))
            self._done_at[request_id] = time.monotonic()

    async def retrieve(self, request_id: str, owner: str, hold: float = HOLD_S) -> Result | None:
        """The result, or None while pending after ``hold`` seconds; ``KeyError`` for an id unknown to ``owner``."""
        future = self._pending.get(request_id)
        if future is None or self._owner.get(request_id) != owner:
            raise KeyError(request_id)
        try:
            return await asyncio.wait_for(asyncio.shield(future), hold)
        except TimeoutError:
            return None

    def _forget_old(self) -> None:
        cutoff = time.monotonic() - KEEP_S
        for request_id in [r for r, t in self._done_at.items() if t < cutoff]:
            del self._pending[request_id], self._owner[request_id], self._done_at[request_id]
