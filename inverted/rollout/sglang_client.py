"""Async clients for the SGLang server protocol and the sgl-router worker API.

The only modules that know SGLang's URLs and JSON shapes. ``SGLangClient`` talks to one server
(real SGLang or the embedded engine: same code) or, for the routed data plane (``/generate``),
to the router. ``RouterClient`` registers and removes workers with sgl-router 0.3.2's
``/workers`` API. Control and weight routes are never proxied by the router, so callers use one
``SGLangClient`` per worker URL for them. ``WorkersClient`` is the data plane for the fields the
router drops (``return_routed_experts``, the sampling masks' ``return_sampling_mask``): it sends
``/generate`` to the router's workers itself; ``SplitClient`` sends only such calls there.

Retries come from the shared ``HTTPService`` base (``inverted.http_client``): connection errors,
502/503/504 and timeouts of idempotent calls are retried; a 4xx never is.
"""

from __future__ import annotations

import functools
import time
import zlib
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator

import orjson

from inverted.errors import ProtocolError, ServiceError, ServiceUnavailable
from inverted.http_client import HTTPService, Reply, Timeouts

__all__ = [
    "GenerateClient",
    "RouterClient",
    "SGLangClient",
    "ServerKeys",
    "SplitClient",
    "Timeouts",
    "WorkersClient",
    "generate_client",
    "read_output",
    "read_routed_experts",
    "read_sampling_mask",
    "read_unconstrained_logprobs",
    "with_sampling_mask",
]


def _check_success(reply: Reply, body: Any) -> dict[str, Any]:
    """Weight and control routes answer ``{"success": bool, "message": str}``; False is an error."""
    if not isinstance(body, dict) or "success" not in body:
        raise ProtocolError("expected {success, message}", url=reply.url, status=reply.status_code, body=reply.text)
    if not body["success"]:
        raise ProtocolError(
            body.get("message") or body.get("error_message") or "failed",
            url=reply.url,
            status=reply.status_code,
            body=reply.text,
        )
    return body


def read_output(body: Any, url: str) -> tuple[list[int], list[float], list[str], list[Any], dict[str, Any] | None]:
    """ids, logprobs, versions, top logprobs and finish reason of one ``/generate`` answer (or cumulative chunk).

    Each token's weight version: ``meta_info.weight_versions`` spans, which both engines report once a
    call is done (the embedded engine mid-stream too, where a call paused across an update mixes
    versions), else ``meta_info.weight_version``.
    """
    try:
        meta = body["meta_info"]
        ids = list(body["output_ids"])
        logprobs = [float(t[0]) for t in meta["output_token_logprobs"]]
        tops = [[(float(lp), int(tid)) for lp, tid, _ in row] for row in meta.get("output_top_logprobs") or []]
        spans = meta.get("weight_versions")
        if spans:
            versions = [span["version"] for span in spans for _ in range(span["end"] - span["start"])]
        else:
            versions = [str(meta["weight_version"])] * len(ids)
        finish = meta.get("finish_reason")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(
            f"/generate answered without output ids, logprobs or versions ({exc})", url=url, body=str(body)[:300]
        ) from None
    if not len(ids) == len(logprobs) == len(versions):
        raise ProtocolError(
            f"/generate answered {len(ids)} ids, {len(logprobs)} logprobs, {len(versions)} versions",
            url=url,
            body=str(body)[:300],
        )
    return ids, logprobs, versions, tops, finish


def read_cached_tokens(body: Any) -> int:
    """``meta_info.cached_tokens``: how much of the prompt the server's prefix cache served (SGLang's
    radix cache, the embedded engine's kept rows); 0 where it says nothing."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    cached = meta.get("cached_tokens") if isinstance(meta, dict) else None
    return cached if isinstance(cached, int) else 0


def read_unconstrained_logprobs(body: Any) -> list[float] | None:
    """``meta_info.output_token_unconstrained_logprobs`` of a constrained call's answer: each token's
    logprob before the grammar's mask (the embedded engine's addition, ``engine/grammar.py``); None
    where the server sends none (SGLang)."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    values = meta.get("output_token_unconstrained_logprobs") if isinstance(meta, dict) else None
    return [float(v) for v in values] if isinstance(values, list) else None


def read_routed_experts(body: Any) -> str | None:
    """``meta_info.routed_experts`` of a finished ``/generate`` answer that asked for
    ``return_routed_experts`` (MoE): base64 of int32 ``[prompt + completion - 1, layers, top_k]``, as
    SGLang sends it (kept so, compact, for the Sample); None where the answer has none."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    routes = meta.get("routed_experts") if isinstance(meta, dict) else None
    return routes if isinstance(routes, str) else None


def truncates(params: dict[str, Any]) -> bool:
    """Whether SGLang samples with these parameters from a cut distribution (top_p, top_k or min_p;
    greedy calls are not sampled)."""
    top_k = params.get("top_k")
    return params.get("temperature", 1.0) > 0 and (
        params.get("top_p", 1.0) < 1 or (top_k or -1) > 0 or params.get("min_p", 0.0) > 0
    )


def with_sampling_mask(payload: dict[str, Any], top_k: int) -> dict[str, Any]:
    """A ``/generate`` payload that asks for each token's sampling mask (``return_sampling_mask``) where
    its sampling truncates: SGLang returns one only under a finite ``top_k`` (at most the server's
    ``--sampling-mask-max-tokens``), so a call that names none gets ``top_k`` (prime-rl's bound is
    512). ``top_k`` 0: masks are not asked for; the payload as it is."""
    params = payload.get("sampling_params") or {}
    if not top_k or not truncates(params):
        return payload
    if params.get("top_k") in (None, -1):
        params = {**params, "top_k": top_k}
    return {**payload, "sampling_params": params, "return_sampling_mask": True}


def read_sampling_mask(body: Any, url: str = "") -> tuple[list[list[int]], list[float]] | None:
    """``meta_info.output_token_sampling_mask`` and ``output_token_sampling_logprobs`` (SGLang's, selected
    mode) of an answer that asked for them: each token's kept set, most likely first, and its log-prob
    renormalised over that set; None where the answer has none."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    masks = meta.get("output_token_sampling_mask") if isinstance(meta, dict) else None
    if masks is None:
        return None
    logprobs, ids = meta.get("output_token_sampling_logprobs"), body.get("output_ids")  # type: ignore[union-attr]
    if not (
        isinstance(masks, list)
        and isinstance(logprobs, list)
        and isinstance(ids, list)
        and len(masks) == len(logprobs) == len(ids)
    ):
        raise ProtocolError(
            "/generate answered sampling masks without one mask and one log-prob per output id",
            url=url,
            body=str(body)[:300],
        )
    return [list(map(int, row)) for row in masks], [float(v) for v in logprobs]


async def without_sampling_masks(client: "SGLangClient") -> str | None:
    """Why the server does not return sampling masks (one token asked for its set), None where it does."""
    probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "top_k": 2}, "return_sampling_mask": True}
    try:
        kept = read_sampling_mask(await client.generate(probe), client.base_url)
    except ServiceError as error:
        return str(error)
    return None if kept is not None and len(kept[0]) == 1 else "its answer has no meta_info.output_token_sampling_mask"


@dataclass(frozen=True, slots=True)
class ServerKeys:
    """The keys of a job's rollout servers: ``api`` on generation and info routes (the router's
    key, which it sends on), ``admin`` on weight and control routes."""

    api: str | None = None
    admin: str | None = None


class SGLangClient(HTTPService):
    """One SGLang-protocol server (or, for ``generate``, the router in front of several).

    ``api_key`` goes with every call; ``admin_api_key``, where given, with the weight and control
    calls instead: SGLang takes the admin key alone on those routes and the plain key alone on the
    others (``/generate``, ``/server_info``), once a server has both.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, admin_api_key: str | None = None, **options: Any):
        super().__init__(base_url, api_key=api_key, **options)
        self._admin = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else None

    @classmethod
    def keyed(cls, base_url: str, keys: ServerKeys, **options: Any) -> "SGLangClient":
        return cls(base_url, api_key=keys.api, admin_api_key=keys.admin, **options)

    # ---- data plane ----------------------------------------------------------------------

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """``POST /generate``; one object for a single prompt, a list for batches and ``n > 1``."""
        response = await self.request(
            "POST",
            "/generate",
            json_body={**payload, "stream": False},
            timeout=self.timeouts.generate,
            idempotent=False,
        )
        return self.json_of(response)

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """``POST /generate`` with ``stream``: yields each cumulative chunk until ``[DONE]``."""
        lines = self.lines("POST", "/generate", json_body={**payload, "stream": True}, timeout=self.timeouts.generate)
        async with aclosing(lines):
            async for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                chunk = orjson.loads(data)
                if "error" in chunk:
                    raise ProtocolError(
                        "stream error", url=self.base_url + "/generate", body=data.decode(errors="replace")
                    )
                yield chunk

    # ---- health and info -----------------------------------------------------------------

    async def health(self) -> bool:
        return await self.probe("/health", self.timeouts.health)

    async def health_generate(self, timeout: float = 30.0) -> bool:
        return await self.probe("/health_generate", timeout)

    async def ready(self) -> bool:
        return await self.probe("/ready", self.timeouts.health)

    async def _get_json(self, path: str) -> Any:
        response = await self.request("GET", path, timeout=self.timeouts.control, idempotent=True)
        return self.json_of(response)

    async def model_info(self) -> dict[str, Any]:
        return await self._get_json("/model_info")

    async def server_info(self) -> dict[str, Any]:
        return await self._get_json("/server_info")

    async def weight_version(self) -> str:
        return (await self.model_info())["weight_version"]

    async def metrics(self) -> dict[str, float]:
        """``/metrics`` (Prometheus text) as ``{sample: value}``; a sample keeps its labels: ``name{...}``."""
        response = await self.request("GET", "/metrics", timeout=self.timeouts.control, idempotent=True)
        samples = {}
        for line in response.text.splitlines():
            if line.strip() and not line.startswith("#"):
                sample, _, value = line.rpartition(" ")
                samples[sample] = float(value)
        return samples

    # ---- control -------------------------------------------------------------------------

    async def _post(
        self, path: str, body: dict[str, Any], *, timeout: float | None = None, idempotent: bool = True
    ) -> Reply:
        return await self.request(
            "POST",
            path,
            json_body=body,
            timeout=timeout or self.timeouts.control,
            idempotent=idempotent,
            headers=self._admin,
        )

    async def pause_generation(self, mode: str = "abort") -> None:
        await self._post("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._post("/continue_generation", {})

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self._post("/abort_request", {"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> bool:
        """True if flushed; False if the server refused because requests are running or queued."""
        try:
            await self._post("/flush_cache", {})
        except ProtocolError as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> str:
        response = await self._post(
            "/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests}
        )
        return _check_success(response, self.json_of(response))["new_version"]

    # ---- weights (sglang-api.md §4) ---------------------------------------------------------

    async def _update(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A weight route: ``{success, message}``; a refusal (400, success false) raises ProtocolError
        with its message."""
        try:
            response = await self._post(path, body, timeout=self.timeouts.weights, idempotent=False)
        except ProtocolError as exc:
            try:
                body = orjson.loads(exc.body)
                message = body.get("message") or body.get("error_message") or ""
            except (ValueError, AttributeError):
                message = ""
            raise ProtocolError(
                f"POST {path} failed: {message or 'rejected'}", url=exc.url, status=exc.status, body=exc.body
            ) from None
        return _check_success(response, self.json_of(response))

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        return await self._update(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "weight_version": weight_version,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
            },
        )

    async def begin_weight_update(self) -> None:
        """Open the update session that tensor and distributed updates need (SGLang >= 0.5.21)."""
        await self._update("/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self) -> None:
        await self._update("/end_weight_update", {})

    async def update_weights_from_tensor(
        self,
        payloads: list[str],
        *,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """``payloads``: one serialized entry per server TP rank (``inverted.weight_wire.serialize``)."""
        return await self._update(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": payloads,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, *, group_name: str, backend: str
    ) -> dict[str, Any]:
        """Blocks until the group forms: the trainer must join it concurrently."""
        return await self._update(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> dict[str, Any]:
        """Returns once the server has taken the trainer's broadcast(s), issued concurrently by the caller."""
        return await self._update(
            "/update_weights_from_distributed",
            {
                "names": names,
                "dtypes": dtypes,
                "shapes": shapes,
                "group_name": group_name,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "weight_version": weight_version,
            },
        )

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._update("/destroy_weights_update_group", {"group_name": group_name})

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
        """``{success, error_message, loaded_adapters}``; a refusal raises ProtocolError with its message."""
        return await self._update("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": pinned})

    async def load_lora_adapter_from_tensors(
        self, name: str, config: dict[str, Any], payloads: list[str], *, load_format: str | None = "flattened_bucket"
    ) -> dict[str, Any]:
        """``config``: PEFT's adapter_config; ``payloads``: one serialized entry per server TP rank."""
        return await self._update(
            "/load_lora_adapter_from_tensors",
            {
                "lora_name": name,
                "config_dict": config,
                "serialized_named_tensors": payloads,
                "load_format": load_format,
            },
        )

    async def unload_lora_adapter(self, name: str, *, missing_ok: bool = False) -> dict[str, Any] | None:
        try:
            return await self._update("/unload_lora_adapter", {"lora_name": name})
        except ProtocolError as exc:
            if missing_ok and exc.status == 400 and "not loaded" in str(exc):
                return None
            raise

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        response = await self._post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        return self.json_of(response)

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post("/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self._post("/resume_memory_occupation", {"tags": tags})


class RouterClient(HTTPService):
    """sgl-router 0.3.2's worker API (``/workers``; the old ``/add_worker`` routes are gone)."""

    async def list_workers(self) -> list[dict[str, Any]]:
        return self.json_of(await self.request("GET", "/workers", timeout=self.timeouts.control, idempotent=True))[
            "workers"
        ]

    async def add_worker(self, url: str, **fields: Any) -> str:
        """Register a worker (asynchronous at the router: poll ``list_workers``); return its id."""
        response = await self.request(
            "POST", "/workers", json_body={"url": url, **fields}, timeout=self.timeouts.control, idempotent=True
        )
        return self.json_of(response)["worker_id"]

    async def remove_worker(self, url: str) -> bool:
        """Remove by URL (the router removes by id): False if no such worker is registered."""
        for worker in await self.list_workers():
            if worker["url"] == url:
                await self.request("DELETE", f"/workers/{worker['id']}", timeout=self.timeouts.control, idempotent=True)
                return True
        return False

    async def healthy_urls(self) -> set[str]:
        return {w["url"] for w in await self.list_workers() if w.get("is_healthy")}

    async def urls(self) -> set[str]:
        return {w["url"] for w in await self.list_workers()}


class WorkersClient:
    """``/generate`` straight to the workers the router lists, for requests the router would change.

    sgl-router 0.3.2 parses ``/generate`` into a typed request that has no ``return_routed_experts``,
    so through it no server is ever asked for routed experts (slime needs its own router for R3,
    ``--use-slime-router``, for the same reason). This client keeps the router as the source of
    truth of which workers serve (re-read every ``refresh_s`` and after a failed call; a URL without
    ``/workers`` is one server, used as it is) and picks one by the prompt's first tokens, so the
    calls of one episode and the samples of one group share a server and its prefix cache. It has
    ``SGLangClient``'s data-plane methods.
    """

    PREFIX = 64  # prompt tokens that pick the worker: a group's shared prompt, an episode's system prompt

    def __init__(
        self,
        router_url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        timeouts: Timeouts = Timeouts(),
        max_connections: int = 256,
        refresh_s: float = 10.0,
    ):
        """``api_key``: the router's (and so its workers') /generate key; ``admin_api_key``: its worker list's."""
        self.base_url = router_url.rstrip("/")
        self.router = RouterClient(router_url, api_key=admin_api_key, timeouts=timeouts)
        self._client = functools.partial(
            SGLangClient, api_key=api_key, timeouts=timeouts, max_connections=max_connections
        )
        self.clients: dict[str, SGLangClient] = {}
        self.refresh_s = refresh_s
        self._workers: list[str] = []
        self._read_at = -float("inf")

    async def _pick(self, payload: dict[str, Any]) -> SGLangClient:
        if not self._workers or time.monotonic() - self._read_at > self.refresh_s:
            try:
                workers = sorted(await self.router.healthy_urls())
            except ProtocolError:  # no /workers: the URL is one server, not a router
                workers = [self.base_url]
            self._workers, self._read_at = workers, time.monotonic()
        if not self._workers:
            raise ServiceUnavailable("the router lists no healthy worker", url=self.base_url + "/workers")
        ids = payload.get("input_ids") or []
        key = zlib.crc32(orjson.dumps(ids[: self.PREFIX] if ids and isinstance(ids[0], int) else ids[:1]))
        url = self._workers[key % len(self._workers)]
        if url not in self.clients:
            self.clients[url] = self._client(url)
        return self.clients[url]

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        client = await self._pick(payload)
        try:
            return await client.generate(payload)
        except ServiceUnavailable:
            self._workers = []  # it may have been replaced: ask the router again next time
            raise

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        client = await self._pick(payload)
        try:
            async with aclosing(client.generate_stream(payload)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ServiceUnavailable:
            self._workers = []
            raise

    async def close(self) -> None:
        await self.router.close()
        for client in self.clients.values():
            await client.close()

    async def __aenter__(self) -> "WorkersClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ``/generate`` fields sgl-router 0.3.2's typed request lacks, so that it drops them on the way.
ROUTER_DROPS = ("return_routed_experts", "return_sampling_mask", "sampling_logprobs_mode")


class SplitClient:
    """``/generate`` through the router, except a call with a field the router drops (``ROUTER_DROPS``),
    which goes to one of its workers (``WorkersClient``: by the prompt's first tokens, so an episode's
    calls keep one server and its prefix cache). ``SGLangClient``'s data-plane methods."""

    def __init__(
        self, router_url: str, *, api_key: str | None = None, admin_api_key: str | None = None, **options: Any
    ):
        self.base_url = router_url.rstrip("/")
        self.router = SGLangClient(router_url, api_key=api_key, **options)
        self.workers = WorkersClient(router_url, api_key=api_key, admin_api_key=admin_api_key, **options)

    def _for(self, payload: dict[str, Any]) -> SGLangClient | WorkersClient:
        return self.workers if any(payload.get(field) for field in ROUTER_DROPS) else self.router

    async def generate(self, payload: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        return await self._for(payload).generate(payload)

    async def generate_stream(self, payload: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        async with aclosing(self._for(payload).generate_stream(payload)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def close(self) -> None:
        await self.router.close()
        await self.workers.close()

    async def __aenter__(self) -> "SplitClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# What ``/generate`` can be called through: one server, the router (with its workers), its workers alone.
GenerateClient = SGLangClient | SplitClient | WorkersClient


def generate_client(
    router_url: str,
    *,
    routed_experts: bool = False,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    **options: Any,
) -> SplitClient | WorkersClient:
    """The client for ``/generate`` behind ``router_url`` (``api_key``: its key): the router, and its
    workers for the calls with a field it drops (a sampling mask: ``SplitClient``); or, where every
    call asks for routed experts, the workers alone (``WorkersClient``). Both list the workers with
    ``admin_api_key``."""
    if routed_experts:
        return WorkersClient(router_url, api_key=api_key, admin_api_key=admin_api_key, **options)
    return SplitClient(router_url, api_key=api_key, admin_api_key=admin_api_key, **options)
