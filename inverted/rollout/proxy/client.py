"""Async client for the proxy's session routes: what a rollout function calls around an episode.

The episode itself talks to ``session.base_url`` with any OpenAI client; this client opens the
session, posts rewards, and finishes it into Samples. Retries come from ``HTTPService``; only
idempotent calls are retried after a send (finishing twice returns the same Samples).
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from typing import Any

import openai

from inverted.http_client import HTTPService
from inverted.types import Reward, Sample


@dataclass(frozen=True, slots=True)
class SessionHandle:
    session_id: str
    token: str
    base_url: str  # give this to the agent's OpenAI client


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def openai_pool() -> openai.DefaultAioHttpClient:
    """One connection pool for the ``openai.AsyncOpenAI`` clients of many episodes (their ``http_client``).

    The SDK's aiohttp transport, and one TLS context for the process: the SDK's client builds a new
    one each time (loading the CA bundle, ~30 ms of CPU); its default client, httpx2, cost 1.9 ms of CPU
    per request in a loopback test, aiohttp 0.3 ms. A pool per episode would cost more than the proxy
    spends serving the call.
    """
    return openai.DefaultAioHttpClient(trust_env=False, verify=_tls_context())


class ProxyClient(HTTPService):
    async def create_session(
        self,
        sample: Sample | None = None,
        sampling_params: dict[str, Any] | None = None,
        script: list[list[int]] | None = None,
    ) -> SessionHandle:
        """A session whose branches become copies of ``sample`` (``task.new_sample()``) with their tokens;
        ``script``: the replies (token ids) its calls answer with instead of sampling."""
        return (
            await self.create_sessions([sample or Sample()], sampling_params, None if script is None else [script])
        )[0]

    async def create_sessions(
        self,
        samples: list[Sample],
        sampling_params: dict[str, Any] | None = None,
        scripts: list[list[list[int]]] | None = None,
    ) -> list[SessionHandle]:
        """One session per Sample to record, all sampling with ``sampling_params`` (or answering from its
        entry of ``scripts``), in one request."""
        body = {
            "sessions": [
                {"sample": s.to_json(), "sampling_params": sampling_params or {}}
                | ({} if scripts is None else {"script": scripts[i]})
                for i, s in enumerate(samples)
            ]
        }
        # Sent again if the answer is lost: the sessions of a lost answer are never used and expire
        # (--proxy-session-timeout), and a proxy that died meanwhile took them with it.
        data = self.json_of(
            await self.request(
                "POST", "/sessions/batch", json_body=body, timeout=self.timeouts.control, idempotent=True
            )
        )
        return [SessionHandle(s["session_id"], s["token"], s["base_url"]) for s in data["sessions"]]

    async def set_reward(self, session_id: str, reward: Reward, finished: bool = True) -> None:
        await self.request(
            "POST",
            f"/sessions/{session_id}/reward",
            json_body={"reward": reward, "finished": finished},
            timeout=self.timeouts.control,
            idempotent=True,
        )

    async def finish(
        self, session_id: str, reward: Reward | None = None, *, only_last: bool = False, side_calls: bool = False
    ) -> list[Sample]:
        """End the session (with its reward, when given) and return its Samples (``only_last``: the
        episode's alone, the last branch of the main model, the one the reward judged; ``side_calls``:
        the last branch of any model)."""
        body = {"reward": reward, "only_last": only_last, "side_calls": side_calls}
        data = self.json_of(
            await self.request(
                "POST", f"/sessions/{session_id}/finish", json_body=body, timeout=self.timeouts.control, idempotent=True
            )
        )
        return [Sample.from_json(s) for s in data["samples"]]

    async def refused(self, session_id: str) -> list[dict[str, Any]]:
        """The session's latest refused calls (``{route, status, message}``), oldest first."""
        data = self.json_of(
            await self.request("GET", f"/sessions/{session_id}", timeout=self.timeouts.control, idempotent=True)
        )
        return data["refused"]

    async def samples(self, session_id: str) -> list[Sample]:
        data = self.json_of(
            await self.request("GET", f"/sessions/{session_id}/samples", timeout=self.timeouts.control, idempotent=True)
        )
        return [Sample.from_json(s) for s in data["samples"]]
