"""The proxy's HTTP service: sessions, the OpenAI routes per session, rewards, Samples, metrics.

Routes (``create_app(config)``):

- ``POST /sessions`` ``{sample?, metadata?, sampling_params?}`` → ``{session_id, token, base_url}``
  (needs ``--proxy-api-key`` when one is set). ``sample`` is the Sample the episode is for, in its
  JSON form, as its task made it (``group_index``, ``index``, ``prompt``, ``label``,
  ``metadata``): every branch becomes a whole copy of it with the recorded tokens. ``metadata`` is
  added to the Samples' metadata. ``sampling_params`` (``temperature``, ``top_p``, ``max_tokens``, ``seed``,
  ``stop``, ...: ``apis.call.OVERRIDES``) override the agent's on every call, whatever its API, e.g.
  the rollout temperature. ``script`` (token ids per reply) makes every call of the session answer
  with the next reply instead of sampling: a recorded episode played again through another agent
  (``rollout_functions.bootstrap``); its Samples carry no rollout log-probs.
- ``POST /sessions/batch`` ``{sessions: [{sample?, metadata?, sampling_params?}, ...]}`` → ``{sessions:
  [...]}``, the same answers in order: all of them or, on any bad entry, none. A rollout opens
  its sessions this way, so that its episodes' first calls reach the servers together.
- ``{base_url}/chat/completions``, ``{base_url}/completions``, ``{base_url}/responses``,
  ``{base_url}/messages`` (Anthropic's), ``{base_url}/models`` with ``base_url = /sessions/{id}/v1``
  (``apis`` holds each API): the path's unguessable id is the capability, so any SDK works with
  only its base URL set; the same under ``/v1/...`` with the session's token as the key
  (``Authorization: Bearer <token>`` or ``x-api-key: <token>``).
- ``POST /sessions/{id}/reward`` ``{reward, finished}``, ``POST /sessions/{id}/finish``
  ``{reward?, only_last?, side_calls?}`` → ``{samples}`` (``only_last``: the episode's Sample alone,
  the last branch of the session's main model, whose final turn the reward judged; ``side_calls``:
  of any model), ``GET /sessions/{id}/samples``, ``GET /sessions/{id}``: allowed with the
  session's own token or the API key (or, with no API key configured, with no token at all).
- ``GET /health``, ``GET /metrics`` (Prometheus text).

Isolation: a bearer token that belongs to another session is refused (403) on every route of
this one; an unknown session is 404. Errors have the body of the route's API (OpenAI's
elsewhere). Sessions idle past
``--proxy-session-timeout`` are finished by a sweeper and their Samples kept for
``--proxy-retention`` seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, AsyncGenerator, Awaitable, Callable

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, JsonValue
from starlette.exceptions import HTTPException

from inverted.auth import NO_DOCS, key_matches, presented_key, require_key
from inverted.errors import InvalidRequest, SampleError, ServiceError, Unauthorized
from inverted.limits import BodyLimit, parse_json
from inverted.plugins import load_plugin
from inverted.processes import UVICORN_OPTIONS, freeze_startup_heap
from inverted.rollout.proxy import apis
from inverted.rollout.proxy.apis import call
from inverted.rollout.proxy.apis.call import Failure
from inverted.rollout.proxy.config import ProxyConfig
from inverted.rollout.proxy.recorder import Recorder
from inverted.rollout.proxy.session import Session, Sessions
from inverted.rollout.sglang_client import Timeouts, generate_client
from inverted.types import Sample

logger = logging.getLogger(__name__)
SWEEP_S = 5.0  # at most; shorter for short timeouts
MAX_BATCH = 4096  # sessions one POST /sessions/batch may open


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sample: dict[str, Any] | None = None  # the episode's Sample as its task made it (JSON form)
    metadata: dict[str, Any] = Field(default_factory=dict)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    # replies to answer the session's calls with, in order, instead of sampling (token ids each)
    script: list[list[int]] | None = None


class CreateSessionResponse(BaseModel):
    session_id: str
    token: str
    base_url: str


class CreateSessionsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sessions: list[CreateSessionRequest] = Field(min_length=1, max_length=MAX_BATCH)


class CreateSessionsResponse(BaseModel):
    sessions: list[CreateSessionResponse]


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: FiniteFloat | dict[str, JsonValue]  # a dict: any JSON beside the numbers (types.Reward)
    finished: bool = True


class FinishRequest(BaseModel):
    """The episode's reward may come with the finish, saving the rollout a round trip."""

    model_config = ConfigDict(extra="forbid")
    reward: FiniteFloat | dict[str, JsonValue] | None = None
    only_last: bool = False  # answer with the episode's Sample only: the last main branch's (all are kept)
    side_calls: bool = False  # with only_last: a side call's branch may be the episode's Sample too


class SamplesResponse(BaseModel):
    session_id: str
    finished: bool
    samples: list[dict[str, Any]]


# Dependencies are ``async def``: FastAPI runs a plain ``def`` one on a worker thread, a thread hop per request.
async def _recorder(request: Request) -> Recorder:
    return request.app.state.recorder


RecorderDep = Annotated[Recorder, Depends(_recorder)]


_require_api_key = require_key(
    lambda request: request.app.state.config.proxy_api_key, "a valid API key is required to create sessions"
)


def _session(request: Request, session_id: str, *, admin: bool) -> Session:
    """The session named in the path, if the caller may use it (see the module docstring)."""
    recorder: Recorder = request.app.state.recorder
    session = recorder.sessions.get(session_id)
    given = presented_key(request, google=True)
    key = request.app.state.config.proxy_api_key
    authorized = key_matches(given, session.token) or key_matches(given, key)
    if given and not authorized and recorder.sessions.by_token.get(given) is not None:
        raise InvalidRequest(
            f"this token belongs to another session, not to {session_id}", code="wrong_session", status=403
        )
    if admin and key and not authorized:
        raise Unauthorized("this route needs the session's token or the API key")
    return session


def _token_session(request: Request) -> Session:
    session = request.app.state.recorder.sessions.by_token.get(presented_key(request, google=True) or "")
    if session is None:
        raise Unauthorized("Incorrect API key provided: use the token of a live session (POST /sessions)")
    return session


def _open_sessions(
    recorder: Recorder, bodies: list[CreateSessionRequest], request: Request, where: str
) -> list[CreateSessionResponse]:
    """Every body checked first, then every session created: a bad one opens none. ``where`` names
    body ``i`` in an error's message and ``param``."""
    templates = []
    limit = recorder.config.proxy_max_session_metadata_bytes
    for i, body in enumerate(bodies):
        at = where.format(i=i)
        if (size := len(orjson.dumps([body.metadata, body.sample]))) > limit:
            raise InvalidRequest(
                f"{at}metadata: {size} bytes of metadata and sample template, over this proxy's "
                f"limit of {limit} (--proxy-max-session-metadata-bytes)",
                param=f"{at}metadata",
            )
        try:  # checked now, so that no call of this session fails on them
            call.check_overrides(body.sampling_params)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{at}sampling_params: {exc}", param=f"{at}sampling_params.{exc.param}") from None
        if body.script is not None:
            _check_script(recorder, body.script, at)
        try:
            templates.append(Sample.from_json(body.sample) if body.sample is not None else None)
        except SampleError as exc:
            raise InvalidRequest(f"{at}sample: {exc}", param=f"{at}sample") from None
    recorder.sessions.make_room(len(bodies))
    base = str(request.base_url).rstrip("/")
    sessions = [
        recorder.sessions.create(body.metadata, body.sampling_params, template, body.script)
        for body, template in zip(bodies, templates)
    ]
    return [
        CreateSessionResponse(session_id=s.id, token=s.token, base_url=f"{base}/sessions/{s.id}/v1") for s in sessions
    ]


def _check_script(recorder: Recorder, script: list[list[int]], at: str) -> None:
    """A script's replies are token ids of this tokenizer, none empty, no more of them than a session
    may take turns, none longer than the context."""
    vocab = len(recorder.tokenizer)
    limit = recorder.config.proxy_max_turns
    if limit and len(script) > limit:
        raise InvalidRequest(
            f"{at}script: {len(script)} replies, more than the {limit} turns a session may take (--proxy-max-turns)",
            param=f"{at}script",
        )
    for i, reply in enumerate(script):
        if not reply or len(reply) > recorder.context_length:
            raise InvalidRequest(
                f"{at}script[{i}]: a reply holds 1 to {recorder.context_length} tokens, not {len(reply)}",
                param=f"{at}script[{i}]",
            )
        if not all(0 <= t < vocab for t in reply):
            raise InvalidRequest(f"{at}script[{i}]: token ids lie in [0, {vocab})", param=f"{at}script[{i}]")


async def _json(request: Request) -> tuple[Any, bytes]:
    """The parsed body and its raw bytes (which key retried calls for replay)."""
    raw = await request.body()
    try:
        return await parse_json(raw), raw
    except (ValueError, RecursionError) as exc:  # malformed, or nested too deep for the parser
        raise InvalidRequest(f"We could not parse the JSON body of your request ({exc})", code="invalid_json") from None


async def _sse(
    api: apis.Api, events: AsyncGenerator[tuple[str | None, dict[str, Any]], None]
) -> AsyncGenerator[bytes, None]:
    """SSE events. When the agent hangs up, Starlette cancels this stream; closing ``events`` then
    rolls the call back and ends its engine request."""
    sent = 0
    async with aclosing(events):
        try:
            async for name, data in events:
                yield _event(name, data)
                sent += 1
        except (InvalidRequest, ServiceError) as exc:  # headers are sent: the error becomes the last event
            yield _event(*api.stream_error(call.failure(exc), sent))
    yield api.done


def _event(name: str | None, data: dict[str, Any]) -> bytes:
    return (f"event: {name}\n".encode() if name else b"") + b"data: " + json.dumps(data).encode() + b"\n\n"


async def _call(request: Request, session: Session, api: apis.Api) -> Response:
    recorder: Recorder = request.app.state.recorder
    body, raw = await _json(request)
    req = api.parse(body, session)
    req.model = request.path_params.get("model", req.model)  # Gemini names it in the path
    if req.stream and api.prefix == "/v1beta" and request.query_params.get("alt") != "sse":
        raise InvalidRequest("streamGenerateContent is served as server-sent events only: add ?alt=sse", param="alt")
    recorder.offer(req)
    call.apply_overrides(req, session.overrides)
    if req.stream:
        events = api.events(req, recorder.stream(session, req))
        first = await anext(events)  # placement and validation errors still get a proper status code
        return StreamingResponse(_sse(api, _prepend(first, events)), media_type="text/event-stream")
    policy = recorder.config.proxy_replay_retries
    key = None if policy == "off" else hashlib.blake2b(api.name.encode() + raw, digest_size=16).hexdigest()
    retry = request.headers.get("x-stainless-retry-count", "0")
    replay = policy == "always" or (retry.isdigit() and int(retry) > 0)
    return JSONResponse(api.answer(req, await recorder.complete(session, req, key, replay)))


async def _count(request: Request, session: Session, api: apis.Api) -> Response:
    """How many tokens a request's prompt renders to, as its API answers a count (nothing is recorded)."""
    assert api.count is not None  # the route exists only for an API that counts
    parse, answer = api.count
    body, _ = await _json(request)
    req = parse(body)
    request.app.state.recorder.offer(req)
    return JSONResponse(answer(await request.app.state.recorder.count(req)))


async def _prepend(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncGenerator[Any, None]:
    async with aclosing(rest):  # closing this closes the call's own stream too
        yield first
        async for item in rest:
            yield item


def _models(recorder: Recorder) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": recorder.model_name, "object": "model", "created": 0, "owned_by": "inverted"}],
    }


def _samples(session: Session, samples: list[Sample]) -> SamplesResponse:
    return SamplesResponse(session_id=session.id, finished=session.finished, samples=[s.to_json() for s in samples])


def create_app(config: ProxyConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
        from inverted.hf_checkpoint import context_length, load_tokenizer  # torch: in the service, not on import

        tokenizer = load_tokenizer(config.tokenizer, config.chat_template)
        parser = load_plugin(config.proxy_tool_parser_path, flag="--proxy-tool-parser-path", params=[])()
        context = context_length(config.tokenizer, config.context_length)  # the servers' own rule
        client = generate_client(
            config.router_url,
            routed_experts=config.return_routed_experts,
            api_key=config.router_api_key,
            admin_api_key=config.router_admin_api_key,
            timeouts=Timeouts(generate=config.proxy_generate_timeout),
            max_connections=1024,
        )
        app.state.recorder = Recorder(
            config,
            tokenizer,
            client,
            parser,
            context,
            config.served_model_name or Path(config.tokenizer).resolve().name,
        )
        sweeper = asyncio.create_task(_sweep(app.state.recorder))
        freeze_startup_heap()
        logger.info("proxy ready: router %s, context %d tokens", config.router_url, context)
        try:
            yield
        finally:
            sweeper.cancel()
            await client.close()

    app = FastAPI(title="inverted proxy", lifespan=lifespan, **NO_DOCS)
    app.add_middleware(BodyLimit, max_bytes=config.proxy_max_request_bytes)
    app.state.config = config
    _add_error_handlers(app)
    _add_session_routes(app)
    _add_api_routes(app)
    return app


async def _sweep(recorder: Recorder) -> None:
    while True:
        await asyncio.sleep(min(SWEEP_S, recorder.sessions.idle_timeout / 2))
        recorder.sessions.sweep()


SESSION_PATH = re.compile(r"^/sessions/([^/]+)")


def _answer_error(request: Request, failure: Failure) -> JSONResponse:
    """Every error answer. A 4xx is also logged with its route and reason, counted in ``/metrics``,
    and kept on the caller's session: an agent that gets refused (a route we lack, a bad field) and
    gives up fails its episode, and the failed Sample says what was refused."""
    status, message = failure.status, failure.message
    if status < 500:
        route = getattr(request.scope.get("route"), "path", None)
        path = route or SESSION_PATH.sub("/sessions/{session_id}", request.url.path)[:200]
        logger.warning("%s %s answered %d: %s", request.method, path, status, message[:500])
        recorder: Recorder = request.app.state.recorder
        recorder.metrics.rejected.labels(route=route or "(no route)", status=str(status)).inc()
        session = _caller_session(request)
        if session is not None:
            session.refused.append({"route": f"{request.method} {path}", "status": status, "message": message[:500]})
    return JSONResponse(apis.for_path(request.url.path).error_body(failure), status_code=status)


def _caller_session(request: Request) -> Session | None:
    """The session whose own token came with the request (in the path's session, or as the bearer)."""
    sessions = request.app.state.recorder.sessions
    given = presented_key(request, google=True) or ""
    named = SESSION_PATH.match(request.url.path)
    session = sessions.by_token.get(given) if given else None
    if named is not None:
        try:
            session = sessions.get(named.group(1))
        except InvalidRequest:
            return None
        # a capability path: its id is the credential, unless another session's token came with it
        if given and not key_matches(given, session.token) and sessions.by_token.get(given) is not None:
            return None
    return session


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:  # 404s, and 413 from BodyLimit
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _answer_error(request, Failure(exc.status_code, kind, str(exc.detail), code=code))

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(ServiceError)
    async def known(request: Request, exc: Exception) -> JSONResponse:
        return _answer_error(request, call.failure(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _answer_error(request, Failure(400, "invalid_request_error", f"{param}: {first['msg']}", param))


def _add_session_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(recorder: RecorderDep) -> Response:
        return Response(generate_latest(recorder.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.post("/sessions", dependencies=[Depends(_require_api_key)])
    async def create_session(
        body: CreateSessionRequest, request: Request, recorder: RecorderDep
    ) -> CreateSessionResponse:
        return _open_sessions(recorder, [body], request, where="")[0]

    @app.post("/sessions/batch", dependencies=[Depends(_require_api_key)])
    async def create_sessions(
        body: CreateSessionsRequest, request: Request, recorder: RecorderDep
    ) -> CreateSessionsResponse:
        return CreateSessionsResponse(sessions=_open_sessions(recorder, body.sessions, request, where="sessions[{i}]."))

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        session = _session(request, session_id, admin=True)
        return {
            "session_id": session.id,
            "finished": session.finished,
            "expired": session.expired,
            "turns": session.turns,
            "branches": len(session.branches),
            "inflight": session.inflight,
            "reward": session.reward,
            "metadata": session.metadata,
            "refused": list(session.refused),
        }

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, body: RewardRequest, request: Request) -> dict[str, Any]:
        session = _session(request, session_id, admin=True)
        if session.finished:
            raise InvalidRequest(
                f"session {session_id} is finished; its reward can no longer change",
                code="session_finished",
                status=409,
            )
        session.set_reward(body.reward, body.finished)
        return {"session_id": session.id, "reward": body.reward, "finished": body.finished}

    @app.post("/sessions/{session_id}/finish")
    async def finish(
        session_id: str, request: Request, recorder: RecorderDep, body: FinishRequest | None = None
    ) -> SamplesResponse:
        session = _session(request, session_id, admin=True)
        if session.inflight:
            raise InvalidRequest(
                f"session {session_id} has {session.inflight} calls running; finish it after they return",
                code="session_busy",
                status=409,
            )
        if body is not None and body.reward is not None and not session.finished:
            session.set_reward(body.reward, True)
        samples = recorder.sessions.finish(session)
        if body is not None and body.only_last:
            samples = Sessions.episode(samples, body.side_calls)
        return _samples(session, samples)

    @app.get("/sessions/{session_id}/samples")
    async def samples(session_id: str, request: Request) -> SamplesResponse:
        session = _session(request, session_id, admin=True)
        return _samples(session, session.samples if session.samples is not None else session.build_samples())


def _add_api_routes(app: FastAPI) -> None:
    """Every API's route twice: under the session's path (its id is the capability) and under ``/v1``
    with the session's token as the key."""
    for api in apis.APIS:
        in_session, with_token = _endpoints(api, _call)
        app.add_api_route("/sessions/{session_id}" + api.prefix + api.route, in_session, methods=["POST"])
        app.add_api_route(api.prefix + api.route, with_token, methods=["POST"])
        if api.count is not None:
            route = api.prefix + (api.count_route or api.route + "/count_tokens")
            in_session, with_token = _endpoints(api, _count)
            app.add_api_route("/sessions/{session_id}" + route, in_session, methods=["POST"])
            app.add_api_route(route, with_token, methods=["POST"])

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request, recorder: RecorderDep) -> dict[str, Any]:
        _session(request, session_id, admin=False)
        return _models(recorder)

    @app.get("/v1/models")
    async def models(request: Request, recorder: RecorderDep) -> dict[str, Any]:
        _token_session(request)
        return _models(recorder)


Handler = Callable[[Request, Session, apis.Api], Awaitable[Response]]


def _endpoints(
    api: apis.Api, handler: Handler
) -> tuple[Callable[..., Awaitable[Response]], Callable[..., Awaitable[Response]]]:
    async def in_session(session_id: str, request: Request) -> Response:
        return await handler(request, _session(request, session_id, admin=False), api)

    async def with_token(request: Request) -> Response:
        return await handler(request, _token_session(request), api)

    return in_session, with_token


def serve(config: ProxyConfig) -> None:
    import uvicorn

    uvicorn.run(create_app(config), host=config.proxy_host, port=config.proxy_port, **UVICORN_OPTIONS)
