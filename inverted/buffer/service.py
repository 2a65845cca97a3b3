"""The Data Buffer's HTTP service (``create_app``): thin routes over ``SQLiteStore``.

Routes validate what enters (pydantic request models; every Sample through ``Sample.validate``), run the
store on one dedicated thread per process (SQLite work never blocks the event loop), and map domain
errors to status codes in one place: a broken Sample or an unknown group is 422 naming the field, a void
lease is 409, a bad key is 401. Bodies use OpenAI's error shape.

Ingest is the hot path (thousands of 1,024-token Samples per second), so ``POST /samples`` is
decoded by msgspec rather than pydantic, each sample's JSON handed to ``Sample.from_json`` as
the client sent it (types checked in C) and stored without re-encoding.

``GET /batches/{request_id}`` answers the batch a ``POST /batches/next`` with that ``request_id``
was served, consuming nothing (404 if none was): a resumed job's step finds the batch its dead
predecessor was served for it, and the trainer's ranks read the Samples of the batch the job's
driver was served by reference. Either route answers a batch *by reference* when asked
(``samples: false``, ``?samples=false``): its id, and each group's size and staleness, no Samples.

``POST /batches/{batch_id}/trained`` records the training step that trained a batch, once (its
groups' ``trained_step``; the same step again is a no-op, another is 409): with it the buffer holds
each task's outcome, trained in which step, filtered, failed or dropped.

``POST /batches/next`` long-polls: it waits (up to ``timeout_s``) until enough groups are complete,
woken at once by submissions to this process, and every ``RECHECK_S`` for those that reached
another worker process (``--workers``: several processes share the database; every state change
is a transaction, so they need nothing else in common).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator, Callable

import msgspec
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException

from inverted.auth import NO_DOCS, require_key
from inverted.buffer.config import BufferConfig
from inverted.buffer.datasets import load_prompts
from inverted.buffer.filters import load_group_chooser, load_group_filter
from inverted.buffer.store import SQLiteStore
from inverted.errors import LeaseConflict, PluginFailed, SampleError, Unauthorized
from inverted.limits import BodyLimit
from inverted.processes import UVICORN_OPTIONS, freeze_startup_heap, serve_workers
from inverted.types import Sample, unfold_siblings, version_number

logger = logging.getLogger(__name__)

MAX_LONG_POLL_S = 300.0
RECHECK_S = 0.25
CONFIG_ENV = "INVERTED_BUFFER_CONFIG"  # how ``serve`` hands the config to its worker processes


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=1, le=4096)
    worker_id: str = Field(min_length=1, max_length=200)
    lease_seconds: float | None = Field(default=None, gt=0, le=86400)
    request_id: str | None = Field(default=None, max_length=200)


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(min_length=1, max_length=200)


class LeaseResponse(BaseModel):
    tasks: list[dict[str, Any]]


class SubmitItem(msgspec.Struct, forbid_unknown_fields=True):
    lease_id: str
    sample: msgspec.Raw  # the sample's JSON as sent: decoded below, stored as is


class SubmitRequest(msgspec.Struct, forbid_unknown_fields=True):
    samples: list[SubmitItem]


SUBMIT_DECODER = msgspec.json.Decoder(SubmitRequest)


class SubmitResponse(BaseModel):
    accepted: int
    duplicates: int
    requeued: int
    completed_groups: list[int]


class TrainedRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int = Field(ge=0)


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_groups: int | None = Field(default=None, ge=1)
    num_samples: int | None = Field(default=None, ge=1)
    current_weight_version: int | str | None = None
    max_weight_staleness: int | None = Field(default=None, ge=0)
    timeout_s: float = Field(default=0.0, ge=0, le=MAX_LONG_POLL_S)
    allow_partial: bool = False
    request_id: str | None = Field(default=None, max_length=200)
    samples: bool = True  # false: the batch by reference (``store.batch_ref``)

    @model_validator(mode="after")
    def one_size(self) -> "BatchRequest":
        if (self.num_groups is None) == (self.num_samples is None):
            raise ValueError("give exactly one of num_groups and num_samples")
        return self


class BufferState:
    """What the routes share: the store, its thread, and the event that wakes long-polls."""

    def __init__(self, config: BufferConfig, store: SQLiteStore):
        self.config = config
        self.store = store
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="buffer-store")
        self.changed = asyncio.Event()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def notify(self) -> None:
        """Wake every long-poll waiting now; later waiters get a fresh event."""
        self.changed.set()
        self.changed = asyncio.Event()


def build_store(config: BufferConfig) -> SQLiteStore:
    prompts = None
    if config.prompt_data:
        prompts = load_prompts(
            config.prompt_data,
            input_key=config.input_key,
            label_key=config.label_key,
            metadata_key=config.metadata_key,
            tool_key=config.tool_key,
        )
    return SQLiteStore(
        config.db,
        n_samples_per_prompt=config.n_samples_per_prompt,
        prompts=prompts,
        shuffle=config.rollout_shuffle,
        seed=config.rollout_seed,
        num_epoch=config.num_epoch,
        partial_rollout=config.partial_rollout,
        stale_policy=config.stale_policy,
        group_filter=load_group_filter(config),
        group_chooser=load_group_chooser(config),
    )


# Dependencies are ``async def``: FastAPI runs a plain ``def`` one on a worker thread, a thread hop per request.
async def _state(request: Request) -> BufferState:
    return request.app.state.buffer


StateDep = Annotated[BufferState, Depends(_state)]


_require_key = require_key(
    lambda request: request.app.state.buffer.config.api_key,
    "a valid 'Authorization: Bearer <api key>' header is required",
)


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status
    )


def create_app(config: BufferConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = build_store(config)
        app.state.buffer = BufferState(config, store)
        freeze_startup_heap()
        logger.info(
            "buffer ready: %s (%d prompts, %d samples per prompt)",
            config.db,
            store.num_prompts,
            config.n_samples_per_prompt,
        )
        try:
            yield
        finally:
            app.state.buffer.executor.shutdown(wait=True)
            store.close()

    app = FastAPI(title="inverted Data Buffer", lifespan=lifespan, **NO_DOCS)
    app.add_middleware(BodyLimit, max_bytes=config.buffer_max_request_bytes)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:  # 404s, and 413 from BodyLimit
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            exc.status_code, "http_error"
        )
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(SampleError)
    async def sample_error(_: Request, exc: SampleError) -> JSONResponse:
        return _error(422, str(exc), "invalid_sample", str(exc).split(":", 1)[0])

    @app.exception_handler(PluginFailed)
    async def plugin_failed(_: Request, exc: PluginFailed) -> JSONResponse:  # the job shows it, traceback and all
        return _error(500, str(exc), "plugin_error")

    @app.exception_handler(LeaseConflict)
    async def lease_conflict(_: Request, exc: LeaseConflict) -> JSONResponse:
        return _error(409, str(exc), "lease_conflict")

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return _error(401, str(exc), "unauthorized")

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return _error(
            422, f"{where}: {first['msg']}" if where else first["msg"], "invalid_request_error", where or None
        )

    _add_routes(app)
    return app


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    """orjson for the (large) body, then the route's pydantic model."""
    try:
        data = orjson.loads(await request.body())
        return model.model_validate(data)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError([{"loc": ("body",), "msg": f"malformed JSON: {exc}"}]) from None
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _samples(raw: bytes) -> tuple[list[tuple[str, Sample]], list[bytes]]:
    """Decode and check every Sample before any is stored (a submission is all or nothing)."""
    try:
        body = SUBMIT_DECODER.decode(raw)
    except msgspec.ValidationError as exc:  # well-formed JSON of the wrong shape; the message has the path
        raise RequestValidationError([{"loc": ("body",), "msg": str(exc)}]) from None
    except msgspec.DecodeError as exc:
        raise RequestValidationError([{"loc": ("body",), "msg": f"malformed JSON: {exc}"}]) from None
    except RecursionError:  # msgspec has no depth limit of its own
        raise RequestValidationError([{"loc": ("body",), "msg": "malformed JSON: nested too deeply"}]) from None
    if not body.samples:
        raise RequestValidationError([{"loc": ("samples",), "msg": "at least one sample is required"}])
    items, blobs = [], []
    for i, item in enumerate(body.samples):
        try:
            sample = Sample.from_json(item.sample)  # straight from the bytes as sent, elements checked
            sample.validate(elements_checked=True)
            unfold_siblings([sample])  # a task's fan-out: each of its other Samples checked too
        except SampleError as exc:
            raise SampleError(f"samples[{i}].{exc}") from None
        items.append((item.lease_id, sample))
        blobs.append(bytes(item.sample))
    return items, blobs


def _add_routes(app: FastAPI) -> None:
    auth = [Depends(_require_key)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/tasks/lease", dependencies=auth, response_model=LeaseResponse)
    async def lease(request: Request, state: StateDep) -> Response:
        body: LeaseRequest = await _parse(request, LeaseRequest)
        seconds = body.lease_seconds or state.config.lease_seconds
        tasks = await state.run(state.store.lease, body.count, body.worker_id, seconds, body.request_id)
        return Response(orjson.dumps({"tasks": tasks}), media_type="application/json")

    @app.post("/tasks/release", dependencies=auth)
    async def release(request: Request, state: StateDep) -> dict[str, int]:
        body: ReleaseRequest = await _parse(request, ReleaseRequest)
        return {"released": await state.run(state.store.release, body.worker_id)}

    @app.post("/samples", dependencies=auth, response_model=SubmitResponse)
    async def submit(request: Request, state: StateDep) -> SubmitResponse:
        items, blobs = _samples(await request.body())
        result = await state.run(state.store.submit, items, blobs)
        if result.completed_groups:
            state.notify()
        return SubmitResponse(
            accepted=result.accepted,
            duplicates=result.duplicates,
            requeued=result.requeued,
            completed_groups=result.completed_groups,
        )

    @app.post("/batches/next", dependencies=auth)
    async def next_batch(request: Request, state: StateDep) -> Response:
        body: BatchRequest = await _parse(request, BatchRequest)
        size = state.config.n_samples_per_prompt
        if body.num_groups is not None:  # or else num_samples (BatchRequest.one_size)
            groups = body.num_groups
        elif body.num_samples is not None and body.num_samples % size == 0:
            groups = body.num_samples // size
        else:
            raise SampleError(f"num_samples: {body.num_samples} is not a multiple of the group size {size}")
        version = None if body.current_weight_version is None else version_number(str(body.current_weight_version))
        deadline = time.monotonic() + body.timeout_s
        while True:
            changed = state.changed  # taken before looking, so a completion in between is not missed
            last_try = time.monotonic() >= deadline
            reply = await state.run(
                state.store.next_batch,
                groups,
                version,
                body.max_weight_staleness,
                body.request_id,
                body.allow_partial and last_try,
                body.samples,
            )
            if reply is not None:
                return Response(reply, media_type="application/json")
            if last_try:
                return JSONResponse({"batch_id": None, "groups": [], "sizes": [], "staleness": [], "timed_out": True})
            try:
                await asyncio.wait_for(changed.wait(), min(RECHECK_S, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass

    @app.get("/batches/{request_id}", dependencies=auth)
    async def served_batch(request_id: str, state: StateDep, samples: bool = True) -> Response:
        reply = await state.run(state.store.served_batch, request_id, samples)
        if reply is None:
            return JSONResponse(
                {"error": {"message": f"no batch was served under request_id {request_id!r}", "type": "not_found"}},
                status_code=404,
            )
        return Response(reply, media_type="application/json")

    @app.post("/batches/{batch_id}/trained", dependencies=auth)
    async def trained(batch_id: str, request: Request, state: StateDep) -> dict[str, int]:
        body: TrainedRequest = await _parse(request, TrainedRequest)
        if not (groups := await state.run(state.store.trained, batch_id, body.step)):
            raise HTTPException(404, f"no batch {batch_id!r} was served")
        return {"groups": groups}

    @app.get("/stats", dependencies=auth)
    async def stats(state: StateDep) -> dict[str, Any]:
        return await state.run(state.store.stats)

    @app.get("/metrics", dependencies=auth)
    async def metrics(state: StateDep) -> PlainTextResponse:
        snapshot = await state.run(state.store.stats)
        lines = [f'inverted_buffer_groups{{state="{k}"}} {v}' for k, v in snapshot["groups"].items()]
        lines += [f'inverted_buffer_tasks{{state="{k}"}} {v}' for k, v in snapshot["tasks"].items()]
        lines += [f"inverted_buffer_{k}_total {v}" for k, v in sorted(snapshot["counters"].items())]
        lines += [
            f'inverted_buffer_consumed_groups_by_staleness{{staleness="{k}"}} {v}'
            for k, v in snapshot["staleness_histogram"].items()
        ]
        lines.append(f"inverted_buffer_samples {snapshot['samples']}")
        return PlainTextResponse("\n".join(lines) + "\n")


def app_from_env() -> FastAPI:
    """The app of each worker process (``serve_workers`` starts them from an import string)."""
    return create_app(BufferConfig(**json.loads(os.environ[CONFIG_ENV])))


def serve(config: BufferConfig, setup: Callable[[], None] | None = None) -> None:
    """Run the service: in this process, or in ``config.workers`` processes on one port, each running
    ``setup`` first (the entry point's: the plug-in adapters its filters may need)."""
    import uvicorn

    if config.workers == 1:
        uvicorn.run(create_app(config), host=config.host, port=config.port, **UVICORN_OPTIONS)
        return
    build_store(config).close()  # create the database and load the dataset once, before the workers race
    os.environ[CONFIG_ENV] = json.dumps(dataclasses.asdict(config))
    serve_workers("inverted.buffer.service:app_from_env", config.host, config.port, config.workers, "buffer", setup)
