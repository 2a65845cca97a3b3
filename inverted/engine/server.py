"""The embedded engine's HTTP server: SGLang's routes over the scheduler (``create_app``).

Routes stay thin: parse (``protocol``), hand work to the ``Scheduler`` (requests via ``submit``,
state changes and weight loads via ``call``), and render SGLang's response shapes. Errors are
raised, never answered route by route: the exception handlers map the error tree to SGLang's
bodies once. Schema violations are ``400 {"error": "<text>"}``; bad values (``InvalidRequest``),
commands the engine cannot run now (``EngineError``) and weights that do not fit (``ModelError``)
are 400 in the route's shape (``protocol.refusal``); malformed or mistyped control bodies are
``400 {"object": "error", ...}``. Anything else is our bug: 500, with the traceback logged by the
server. A failing request never disturbs the others.

LoRA (``--enable-lora``): ``/load_lora_adapter``, ``/load_lora_adapter_from_tensors`` and
``/unload_lora_adapter`` answer SGLang's ``{success, error_message, loaded_adapters}`` (400 on a
refusal), and ``/generate`` takes ``lora_path`` per item (``engine.lora``).

``/health`` answers from the scheduler's liveness (a paused engine stays healthy, so the router
does not evict it during a weight update); ``/health_generate`` runs SGLang's 1-token probe.
``/metrics`` adds ``inverted:*`` counters to SGLang's: time spent in prefill and decode, and for
weight loads the seconds spent receiving broadcasts, decoding payloads and copying into the
parameters, so a sender can tell this engine's share of an update from the wire's; and the
grammars compiled for constrained requests (each kept and reused: ``engine/grammar.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from inverted.auth import NO_DOCS, require_key
from inverted.devices import native_bf16
from inverted.engine import protocol as P
from inverted.engine.config import EngineConfig
from inverted.engine.grammar import Grammars
from inverted.engine.lora import Adapters, startup_adapters
from inverted.engine.model import CausalLM, KVCache, load_model
from inverted.engine.sampling import SamplingParams
from inverted.engine.scheduler import Request as EngineRequest
from inverted.engine.scheduler import Scheduler, WeightLoad, new_rid
from inverted.engine.weights import RecentBuckets, UpdateGroups, check_fits, read_checkpoint
from inverted.errors import EngineError, FieldError, InvalidRequest, ModelError, Overloaded, SchemaError, Unauthorized
from inverted.hf_checkpoint import ARCHITECTURES, context_length, longest_prompt, room_after
from inverted.limits import BodyLimit, brief, cannot_fit, max_token_chars, parse_json
from inverted.peft_adapter import read_adapter
from inverted.processes import freeze_startup_heap

logger = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))  # SGLang's own knob
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    """What the routes need: config, tokenizer, scheduler, and the startup facts for /server_info."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        self.config = config
        device = torch.device(config.device)
        dtype = (
            DTYPES[config.dtype]
            if config.dtype != "auto"
            else (torch.float32 if device.type == "cpu" else torch.bfloat16)
        )
        if device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16():
            logger.warning("--dtype bfloat16: this CPU has neither AVX512-BF16 nor AMX; torch emulates it, slower")
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.max_token_chars = max_token_chars(self.tokenizer)
        model = load_model(config.model, dtype, device, config.stored_copy_rows)
        if model.stored_rows:
            logger.info(
                "steps of up to %d rows multiply stored copies of the packed matrices, split among the threads%s",
                model.stored_rows,
                ": faster here by 10 %+, measured at load" if config.stored_copy_rows < 0 else "",
            )
        if config.enable_return_routed_experts and not model.spec.is_moe:
            raise ModelError(
                f"--enable-return-routed-experts needs a Mixture-of-Experts model; {config.model} is dense"
            )
        adapters = startup_adapters(config, model) if config.enable_lora else None
        self.context_length = context_length(config.model, config.context_length)
        self.max_total_tokens = kv_budget(config, model, self.context_length)
        self.scheduler = Scheduler(
            model,
            max_running=config.max_running_requests,
            context_length=self.context_length,
            max_prefill_tokens=config.max_prefill_tokens,
            weight_version=config.weight_version,
            stop_checker=self._matched_stop,
            random_seed=config.random_seed,
            reuse_prefixes=not config.disable_radix_cache,
            update_timeout=config.weight_update_timeout,
            adapters=adapters,
            keep_routes=config.enable_return_routed_experts,
            max_total_tokens=self.max_total_tokens,
        )
        self.model_name = config.served_model_name or config.model
        self.model_path = (
            config.model
        )  # both become a disk update's path, as in SGLang (its /server_info keeps the launch's)
        self._grammars: Grammars | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()
        self.started = time.time()
        self.inflight: dict[str, EngineRequest] = {}
        self.groups = UpdateGroups(timeout=config.weight_update_timeout)
        self.recent_buckets = RecentBuckets()
        self.recent_adapters = RecentBuckets(size=1)  # a LoRA trainer sends its adapter from one buffer

    def grammar_matcher(self, params: SamplingParams) -> Any | None:
        """The matcher of a request's ``json_schema`` or ``regex`` (None without one). CPU work (the
        first builds the vocabulary's token trie): called off the event loop."""
        if params.json_schema is None and params.regex is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.scheduler.model.spec.vocab_size)
        return self._grammars.matcher(params.json_schema, params.regex)

    def _matched_stop(self, req: EngineRequest) -> str | None:
        """The stop string that the newest token completed, if any (only the tail can hold it)."""
        stops = req.params.stops
        tail = req.output_ids[-(4 * max(map(len, stops)) + 4) :]
        text = str(self.tokenizer.decode(tail, skip_special_tokens=req.params.skip_special_tokens))
        return min((s for s in stops if s in text), key=text.find, default=None)  # the first in the text

    def adapters(self) -> Adapters:
        """The LoRA registry; ``InvalidRequest`` on a server started without ``--enable-lora``."""
        return self.scheduler.lora_registry()

    async def run(self, fn, *, barrier: bool = False) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn, barrier=barrier))

    async def load_weights(
        self,
        tensors: Callable[[], dict[str, torch.Tensor]],
        body: P.WeightLoadOptions,
        *,
        complete: bool,
        strict_dtype: bool = True,
    ) -> WeightLoad:
        """``Scheduler.load_weights`` between steps: a barrier (running requests finish first) unless
        it aborts them or an update session already holds all stepping."""
        sched = self.scheduler
        barrier = not body.abort_all_requests and not sched.updating
        return await self.run(
            lambda: sched.load_weights(
                tensors,
                complete=complete,
                strict_dtype=strict_dtype,
                abort_all=body.abort_all_requests,
                weight_version=body.weight_version,
                flush_cache=body.flush_cache,
            ),
            barrier=barrier,
        )


KV_MEMORY_SHARE = 0.25  # of the device's memory, for the KV cache unless --max-total-tokens says


def kv_budget(config: EngineConfig, model: CausalLM, context: int) -> int:
    """The KV cache's positions over all rows: ``--max-total-tokens``, else what a quarter of the device's
    memory holds; never less than one whole context (one request must always fit), never more than
    every row at the whole context."""
    if config.max_total_tokens:
        if config.max_total_tokens < context:
            raise ModelError(
                f"--max-total-tokens {config.max_total_tokens} cannot hold one request of the whole "
                f"context ({context} tokens): raise it, or lower --context-length"
            )
        return config.max_total_tokens
    device = model.device
    memory = (
        torch.cuda.get_device_properties(device).total_memory
        if device.type == "cuda"
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    fits = int(memory * KV_MEMORY_SHARE) // KVCache.position_bytes(model.spec, model.act_dtype)
    return max(context, min(config.max_running_requests * context, fits))


def launch(config: EngineConfig) -> concurrent.futures.Future[Engine]:
    """Build the engine on a new thread, which then runs its scheduler; the future gives the engine once built.

    That thread is the only one in the process that runs torch kernels on several cores. OpenMP
    keeps a pool of worker threads for each thread that opens a parallel region, and once the
    pools hold more threads than there are cores, libgomp stops spinning between regions and puts
    its workers to sleep after each one. A decode step is hundreds of short regions, so that
    costs a third of it (measured on 2 cores: a 32-row step of the small model took 15 ms with one
    pool and 21-23 ms with a second one, left by loading the model on another thread).
    """
    built: concurrent.futures.Future[Engine] = concurrent.futures.Future()

    def main() -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            engine = Engine(config)
        except BaseException as exc:
            built.set_exception(exc)
            return
        freeze_startup_heap()
        built.set_result(engine)
        engine.scheduler.run()

    threading.Thread(target=main, name="engine-scheduler", daemon=True).start()
    return built


# Dependencies are ``async def``: FastAPI runs a plain ``def`` one on a worker thread, a thread hop per request.
async def _engine(request: Request) -> Engine:
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(_engine)]


_require_key = require_key(
    lambda request: request.app.state.engine.config.api_key,
    "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required.",
)
# SGLang: with an admin key set, the plain key is not accepted on control routes.
_require_admin_key = require_key(
    lambda request: request.app.state.engine.config.admin_api_key or request.app.state.engine.config.api_key,
    "Unauthorized: this control route needs the admin API key.",
)


def create_app(config: EngineConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await asyncio.wrap_future(launch(config))
        app.state.engine = engine
        logger.info(
            "engine ready: %s (%s, context %d, %d rows, weight version %r)",
            engine.model_name,
            config.device,
            engine.context_length,
            config.max_running_requests,
            config.weight_version,
        )
        budget, position = (
            engine.max_total_tokens,
            KVCache.position_bytes(engine.scheduler.model.spec, engine.scheduler.model.act_dtype),
        )
        logger.info(
            "KV cache: at most %d positions (%.1f GiB%s): %d requests at the whole context of %d, or "
            "%d of up to %d tokens each",
            budget,
            budget * position / 2**30,
            ", --max-total-tokens" if config.max_total_tokens else ", a quarter of this machine's memory",
            min(config.max_running_requests, budget // engine.context_length),
            engine.context_length,
            config.max_running_requests,
            budget // config.max_running_requests,
        )
        try:
            yield
        finally:
            engine.scheduler.stop()
            engine.groups.close()

    app = FastAPI(title="inverted embedded engine (SGLang protocol)", lifespan=lifespan, **NO_DOCS)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    _add_error_handlers(app)
    _add_generate_routes(app)
    _add_control_routes(app)
    _add_info_routes(app)
    return app


def _refusal(request: Request, message: str) -> Response:
    body = P.refusal(request.url.path, message)
    if isinstance(body, str):
        return PlainTextResponse(body, status_code=400)
    if request.url.path in P.LORA_ROUTES:
        body["loaded_adapters"] = _loaded_adapters(request.app.state.engine)
    return JSONResponse(body, status_code=400)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SchemaError)
    async def schema_error(_: Request, exc: SchemaError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(FieldError)
    async def field_error(_: Request, exc: FieldError) -> JSONResponse:
        return JSONResponse(P.error_body(f"1 validation error: {exc}"), status_code=400)

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        return JSONResponse(P.error_body(str(exc), 401), status_code=401)

    @app.exception_handler(InvalidRequest)
    @app.exception_handler(EngineError)
    async def refused(request: Request, exc: InvalidRequest | EngineError) -> Response:
        return _refusal(request, str(exc))

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return JSONResponse(P.error_body(str(exc), 503), status_code=503)

    @app.exception_handler(ModelError)
    async def weights_do_not_fit(request: Request, exc: ModelError) -> Response:
        if request.url.path in P.LORA_ROUTES:
            return _refusal(request, f"Failed to load the LoRA adapter: {exc}. Nothing was changed.")
        return _refusal(request, f"Failed to update weights: {exc}. Rolled back to the previous weights.")

    @app.exception_handler(Exception)
    async def bug(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this answer, so the server logs the traceback.
        return JSONResponse(
            {"error": {"message": f"Internal server error: {type(exc).__name__}: {exc}"}}, status_code=500
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(P.error_body(f"{where}: {first.get('msg', 'invalid request')}"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(P.error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)


async def _json_body(request: Request) -> dict:
    """The body as FastAPI (0.165, strict about content types) reads SGLang's: JSON under a JSON content
    type; no body, no content type or another one, or JSON that is not an object is refused as pydantic
    refuses it."""
    raw = await request.body()
    if not raw:
        raise FieldError("body: Field required")
    kind = request.headers.get("content-type", "")
    if not _names_json(kind):
        raise FieldError(
            f"body: a JSON object is required, sent as application/json; the content type was {brief(kind)}"
        )
    try:
        body = await parse_json(raw)
    except (ValueError, RecursionError) as exc:  # json's own errors: malformed, or nested too deep
        raise RequestValidationError(
            [{"loc": ("body",), "msg": f"malformed JSON: {exc}", "type": "json_invalid"}]
        ) from None
    if not isinstance(body, dict):
        raise FieldError(f"body: Input should be a dictionary (a JSON object), got {type(body).__name__}")
    return body


def _names_json(content_type: str) -> bool:
    """FastAPI's test: ``application/json`` or ``application/*+json``, whatever the parameters."""
    kind = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _context_exceeded(engine: Engine, prompt_tokens: int, max_new_tokens: int) -> InvalidRequest:
    return InvalidRequest(
        f"Requested token count exceeds the model's maximum context length of {engine.context_length} tokens. "
        f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input "
        f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
        "messages or the completion to fit within the limit."
    )


def _check_text_lengths(engine: Engine, items: list[P.GenerateItem]) -> None:
    """Refuse, by its length alone, a text that cannot fit the context: tokenizing it first could cost minutes."""
    for item in items:
        room = longest_prompt(engine.context_length)  # what _prepare allows it, once tokenized
        if item.params.max_new_tokens_given:
            room = min(room, engine.context_length - item.params.max_new_tokens)
        if item.text is not None and cannot_fit(len(item.text), room, engine.max_token_chars):
            raise InvalidRequest(
                f"Requested token count exceeds the model's maximum context length of {engine.context_length} "
                f"tokens. The input text has {len(item.text)} characters, more than the {room} tokens a prompt may "
                f"have here can hold (one token covers at most {engine.max_token_chars} characters). Please shorten "
                "the input."
            )


def _within_context(engine: Engine, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
    """``max_new_tokens`` cut to what SGLang samples after this prompt (``room_after``: 2 short of the
    context), as SGLang's scheduler cuts it; the KV row is sized to that."""
    room = room_after(prompt_tokens, engine.context_length)
    return params if params.max_new_tokens <= room else params.model_copy(update={"max_new_tokens": room})


def _prepare(engine: Engine, item: P.GenerateItem) -> list[int]:
    """Token ids of an item, checked against the vocabulary and the context length."""
    if item.input_ids is not None:
        ids = item.input_ids
    else:
        ids = engine.tokenizer.encode(item.text, add_special_tokens=True)
    if not ids:
        raise InvalidRequest("input_ids cannot be empty.")
    vocab = engine.scheduler.model.spec.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"input_ids must be in [0, {vocab}): the model's vocabulary size is {vocab}.")
    if outside := [t for t in item.token_ids_logprob or () if not 0 <= t < vocab]:  # SGLang's words
        raise InvalidRequest(
            f"token_ids_logprob contains out-of-vocabulary token id {outside[0]}; valid range is [0, {vocab})."
        )
    if len(ids) >= engine.context_length:  # SGLang's words
        raise InvalidRequest(
            f"The input ({len(ids)} tokens) is longer than the model's context length ({engine.context_length} tokens)."
        )
    if item.params.max_new_tokens_given and len(ids) + item.params.max_new_tokens > engine.context_length:
        raise _context_exceeded(engine, len(ids), item.params.max_new_tokens)
    if len(ids) > longest_prompt(engine.context_length):  # SGLang's words, but for its --allow-auto-truncate
        raise InvalidRequest(
            f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
            f"({longest_prompt(engine.context_length) + 1} tokens). Use a shorter input."
        )
    if item.return_logprob and item.logprob_start_len > len(ids):
        raise InvalidRequest(
            f"req.logprob_start_len={item.logprob_start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
        )
    if item.rid in engine.inflight:
        raise InvalidRequest(f"Duplicate request ID detected: {item.rid}")
    return ids


def _add_generate_routes(app: FastAPI) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"], dependencies=[Depends(_require_key)])
    async def generate(request: Request, engine: EngineDep) -> Response:
        room = engine.config.max_running_requests + engine.config.max_queued_requests
        items, single, stream = P.parse_generate(
            await _json_body(request),
            max_items=room,
            max_prompt_tokens=engine.context_length,
            mask_cap=engine.config.sampling_mask_max_tokens,
        )
        if len(engine.inflight) + len(items) > room:
            raise Overloaded(
                f"The request queue is full: {len(engine.inflight)} requests are running or waiting, "
                f"and this one adds {len(items)} (--max-running-requests + --max-queued-requests = "
                f"{room}). Try again later."
            )
        _check_text_lengths(engine, items)
        if any(item.text is not None for item in items):  # tokenizing is CPU work: off the event loop
            prompts = await asyncio.to_thread(lambda: [_prepare(engine, item) for item in items])
        else:
            prompts = [_prepare(engine, item) for item in items]  # validate all before submitting any
        if len({i.rid for i in items}) != len(items):
            raise InvalidRequest("Duplicate request ID detected within the batch.")
        if named := [item.lora for item in items if item.lora is not None]:
            if engine.scheduler.adapters is None:  # SGLang's words
                raise InvalidRequest(
                    f"LoRA adapter '{named[0]}' was requested, but LoRA is not enabled. Please launch the server "
                    "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
                )
            engine.adapters().check_requested(named)
        if any(item.return_routed_experts for item in items) and not engine.config.enable_return_routed_experts:
            raise InvalidRequest("return_routed_experts needs a server started with --enable-return-routed-experts")
        # a bad constraint: 400, nothing runs; compiling is CPU work, so it leaves the event loop
        if any(item.params.json_schema is not None or item.params.regex is not None for item in items):
            matchers = await asyncio.to_thread(lambda: [engine.grammar_matcher(item.params) for item in items])
        else:
            matchers = [None] * len(items)
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        reqs: list[EngineRequest] = []
        for pos, (item, ids, matcher) in enumerate(zip(items, prompts, matchers)):

            def notify(_req: EngineRequest, n: int, pos: int = pos) -> None:
                loop.call_soon_threadsafe(updates.put_nowait, (pos, n))

            req = EngineRequest(
                rid=item.rid,
                input_ids=ids,
                params=_within_context(engine, item.params, len(ids)),
                notify=notify,
                return_logprob=item.return_logprob,
                logprob_start_len=item.logprob_start_len,
                top_logprobs_num=item.top_logprobs_num,
                token_ids_logprob=item.token_ids_logprob,
                matcher=matcher,
                stream=stream,
                lora=item.lora,
                return_routed_experts=item.return_routed_experts,
                return_sampling_mask=item.return_sampling_mask,
            )
            reqs.append(req)
            engine.inflight[item.rid] = req
        for req in reqs:
            engine.scheduler.submit(req)
        if stream:
            return StreamingResponse(_stream(engine, items, reqs, updates, single), media_type="text/event-stream")
        watcher = asyncio.ensure_future(_hang_up(request, updates))
        try:
            remaining = len(reqs)
            while remaining:
                pos, n = await updates.get()
                if pos == HUNG_UP:  # the client went away: stop the work it asked for
                    _abort(engine, reqs)
                    return Response(status_code=499)
                remaining -= reqs[pos].finished and n == len(reqs[pos].output_ids)
        except asyncio.CancelledError:
            _abort(engine, reqs)
            raise
        finally:
            watcher.cancel()
            _forget(engine, reqs)
        version = engine.scheduler.weight_version
        bodies = [P.generate_response(r, i, len(r.output_ids), engine.tokenizer, version) for r, i in zip(reqs, items)]
        return JSONResponse(bodies[0] if single else bodies)


HUNG_UP = -1  # put in a request's update queue when its client disconnects


async def _hang_up(request: Request, updates: asyncio.Queue) -> None:
    """Wait for the client to disconnect (its body is read: the next message is that), then say so.

    The server does not cancel a handler whose client left before its answer, so without this a
    non-streamed request runs to the end for nobody (the audit left 60,704 queued so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    updates.put_nowait((HUNG_UP, 0))


def _abort(engine: Engine, reqs: list[EngineRequest]) -> None:
    rids = {r.rid for r in reqs if not r.finished}

    def abort() -> None:
        for rid in rids:
            engine.scheduler.abort(rid)

    if rids:
        engine.scheduler.call(abort)


def _forget(engine: Engine, reqs: list[EngineRequest]) -> None:
    for req in reqs:
        if engine.inflight.get(req.rid) is req:
            del engine.inflight[req.rid]
        if engine.config.log_requests:  # SGLang's --log-requests, as one JSON line per finished request
            logger.info(
                "request %s",
                json.dumps(
                    {
                        "rid": req.rid,
                        "input_ids": req.input_ids,
                        "output_ids": req.output_ids,
                        "finish_reason": req.finish_reason,
                    }
                ),
            )


async def _stream(engine: Engine, items, reqs, updates: asyncio.Queue, single: bool) -> AsyncIterator[bytes]:
    """Cumulative SSE chunks (SGLang's default), then ``[DONE]``; a disconnect aborts the requests."""
    done: set[int] = set()
    try:
        while len(done) < len(reqs):
            pos, n = await updates.get()
            req = reqs[pos]
            if pos in done:
                continue
            chunk = P.generate_response(req, items[pos], n, engine.tokenizer, engine.scheduler.weight_version)
            if not single:
                chunk["index"] = pos
            if req.finished and n == len(req.output_ids):
                done.add(pos)
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        if len(done) < len(reqs):
            _abort(engine, reqs)
        _forget(engine, reqs)


def _success(message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": True, "message": message, **extra})


def _loaded(load: WeightLoad, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"success": load.flushed, "message": load.message, **extra}, status_code=200 if load.flushed else 400
    )


OUTSIDE_SESSION = "{route} must run between begin_weight_update() and end_weight_update()."


async def _update_in_session(
    engine: Engine, route: str, body: P.WeightLoadOptions, receive, *, waits_on_peers: bool
) -> JSONResponse:
    """Tensor and distributed updates: only inside a session; ``receive()`` returns the checked tensors.

    A broadcast waits on the trainer, so it is received on a worker thread. A payload only needs
    decoding, so that runs with the copy on the scheduler thread: one thread hop, not two (on a VM
    each hop may wait for an idle vCPU to wake: ~0.3 ms, at times 3-4 ms, measured on 2 cores).
    """
    if not engine.scheduler.updating:
        raise EngineError(OUTSIDE_SESSION.format(route=route))
    engine.scheduler.touch_update()
    if waits_on_peers:
        started = time.perf_counter()
        named = await asyncio.to_thread(receive)
        engine.scheduler.stats["weight_receive_seconds"] += time.perf_counter() - started
        load = await engine.load_weights(lambda: dict(named), body, complete=False)
    else:
        load = await engine.load_weights(lambda: dict(receive()), body, complete=False)
    return _loaded(load)


def _add_control_routes(app: FastAPI) -> None:
    admin = [Depends(_require_admin_key)]

    @app.post("/pause_generation", dependencies=admin)
    async def pause_generation(body: P.PauseGenerationRequest, engine: EngineDep) -> JSONResponse:
        await engine.run(lambda: engine.scheduler.pause(body.mode))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation", dependencies=admin)
    async def continue_generation(body: P.ContinueGenerationRequest, engine: EngineDep) -> JSONResponse:
        await engine.run(engine.scheduler.resume)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request", dependencies=admin)
    async def abort_request(body: P.AbortRequestRequest, engine: EngineDep) -> Response:
        await engine.run(lambda: engine.scheduler.abort(body.rid, body.abort_all))
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=admin)
    async def flush_cache(engine: EngineDep) -> PlainTextResponse:
        await engine.run(engine.scheduler.flush)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weight_version", dependencies=admin)
    async def update_weight_version(body: P.UpdateWeightVersionRequest, engine: EngineDep) -> JSONResponse:
        def apply() -> None:
            if body.abort_all_requests:
                engine.scheduler.abort(abort_all=True)
            engine.scheduler.weight_version = body.new_version

        await engine.run(apply)
        return JSONResponse(
            {
                "success": True,
                "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version,
            }
        )

    @app.post("/update_weights_from_disk", dependencies=admin)
    async def update_weights_from_disk(body: P.UpdateWeightsFromDiskRequest, engine: EngineDep) -> JSONResponse:
        # read and checked whole, as stored, on a worker thread: the copy on the scheduler thread casts them
        tensors = await asyncio.to_thread(read_checkpoint, engine.scheduler.model, body.model_path)
        load = await engine.load_weights(lambda: tensors, body, complete=True, strict_dtype=False)
        if load.flushed:
            engine.model_path = engine.model_name = body.model_path
        return _loaded(load, num_paused_requests=load.paused_requests)

    @app.post("/begin_weight_update", dependencies=admin)
    async def begin_weight_update(body: P.BeginWeightUpdateRequest, engine: EngineDep) -> JSONResponse:
        await engine.run(engine.scheduler.begin_update, barrier=True)
        return _success("Weight update session started.")

    @app.post("/end_weight_update", dependencies=admin)
    async def end_weight_update(engine: EngineDep) -> JSONResponse:
        await engine.run(engine.scheduler.end_update)
        return _success("Weight update session ended.")

    @app.post("/update_weights_from_tensor", dependencies=admin)
    async def update_weights_from_tensor(body: P.UpdateWeightsFromTensorRequest, engine: EngineDep) -> JSONResponse:
        model = engine.scheduler.model
        return await _update_in_session(
            engine,
            "update_weights_from_tensor",
            body,
            lambda: engine.recent_buckets.decoded(
                body.serialized_named_tensors,
                body.load_format,
                model.device,
                check=lambda named: check_fits(model, named),
            ),
            waits_on_peers=False,
        )

    @app.post("/init_weights_update_group", dependencies=admin)
    async def init_weights_update_group(body: P.InitWeightsUpdateGroupRequest, engine: EngineDep) -> JSONResponse:
        if body.backend == "nccl" and engine.scheduler.model.device.type != "cuda":
            raise EngineError("Failed to init group: backend 'nccl' needs a CUDA engine; use 'gloo' on CPU.")
        await asyncio.to_thread(
            engine.groups.join,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
        )
        return _success("Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed", dependencies=admin)
    async def update_weights_from_distributed(
        body: P.UpdateWeightsFromDistributedRequest, engine: EngineDep
    ) -> JSONResponse:
        return await _update_in_session(
            engine,
            "update_weights_from_distributed",
            body,
            lambda: engine.groups.receive(
                engine.scheduler.model, body.group_name, body.names, body.dtypes, body.shapes, body.load_format
            ),
            waits_on_peers=True,
        )

    @app.post("/destroy_weights_update_group", dependencies=admin)
    async def destroy_weights_update_group(body: P.DestroyWeightsUpdateGroupRequest, engine: EngineDep) -> JSONResponse:
        await asyncio.to_thread(engine.groups.destroy, body.group_name)
        return _success("Succeeded to destroy custom process group.")

    _add_lora_routes(app, admin)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"], dependencies=admin)
    async def get_weights_by_name(body: P.GetWeightsByNameRequest, engine: EngineDep) -> JSONResponse:
        slot = engine.scheduler.model.hf_slots.get(body.name)
        if slot is None:
            raise InvalidRequest("Get parameter by name failed")
        values = await engine.run(lambda: slot.view().float().tolist()[: body.truncate_size])
        return JSONResponse(values)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"], dependencies=admin)
    async def release_memory_occupation(body: P.MemoryOccupationRequest, engine: EngineDep) -> JSONResponse:
        await engine.run(lambda: engine.scheduler.release_memory(body.tags or ["weights", "kv_cache", "cuda_graph"]))
        return JSONResponse(None)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"], dependencies=admin)
    async def resume_memory_occupation(body: P.MemoryOccupationRequest, engine: EngineDep) -> JSONResponse:
        await engine.run(lambda: engine.scheduler.resume_memory(body.tags or ["weights", "kv_cache", "cuda_graph"]))
        return JSONResponse(None)


def _loaded_adapters(engine: Engine) -> dict[str, str | None]:
    return engine.scheduler.adapters.names() if engine.scheduler.adapters is not None else {}


def _add_lora_routes(app: FastAPI, admin: list) -> None:
    """SGLang's LoRA routes. They change what the server runs, so they need the admin key (SGLang
    served them without one and got a remote-code-execution CVE for it). An adapter is read and
    checked whole on a worker thread, then added between steps: a bad one changes nothing."""

    async def add(engine: Engine, build: Callable[[], Any]) -> JSONResponse:
        adapters = engine.adapters()
        adapter = await asyncio.to_thread(build)
        await engine.run(lambda: engine.scheduler.add_adapter(adapter))
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": adapters.names()})

    @app.post("/load_lora_adapter", dependencies=admin)
    async def load_lora_adapter(body: P.LoadLoRAAdapterRequest, engine: EngineDep) -> JSONResponse:
        def build():
            config, tensors = read_adapter(body.lora_path)
            return engine.adapters().build(body.lora_name, config, tensors, path=body.lora_path, pinned=body.pinned)

        return await add(engine, build)

    @app.post("/load_lora_adapter_from_tensors", dependencies=admin)
    async def load_lora_adapter_from_tensors(
        body: P.LoadLoRAAdapterFromTensorsRequest, engine: EngineDep
    ) -> JSONResponse:
        def build():
            named = engine.recent_adapters.decoded(body.payloads(), body.load_format, engine.scheduler.model.device)
            return engine.adapters().build(body.lora_name, body.config_dict, dict(named), pinned=body.pinned)

        return await add(engine, build)

    @app.post("/unload_lora_adapter", dependencies=admin)
    async def unload_lora_adapter(body: P.UnloadLoRAAdapterRequest, engine: EngineDep) -> JSONResponse:
        adapters = engine.adapters()
        await engine.run(lambda: engine.scheduler.remove_adapter(body.lora_name))
        return JSONResponse({"success": True, "error_message": None, "loaded_adapters": adapters.names()})


def _model_info(engine: Engine) -> dict[str, Any]:
    spec = engine.scheduler.model.spec
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.model_name,
        "tokenizer_path": engine.config.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.scheduler.weight_version,
        "load_format": "safetensors",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": spec.arch,
        "architectures": [name for name, arch in ARCHITECTURES.items() if arch == spec.arch],
    }


def _server_info(engine: Engine) -> dict[str, Any]:
    cfg = engine.config
    return {
        "model_path": cfg.model,
        "tokenizer_path": cfg.model,
        "served_model_name": cfg.served_model_name or cfg.model,
        "host": cfg.host,
        "port": cfg.port,
        "device": cfg.device,
        "dtype": str(engine.scheduler.model.dtype).removeprefix("torch."),  # resolved: what weight updates must send
        "tp_size": 1,
        "dp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": "null",
        "context_length": engine.context_length,
        "max_running_requests": cfg.max_running_requests,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "weight_version": cfg.weight_version,
        "skip_tokenizer_init": False,
        "max_total_num_tokens": engine.max_total_tokens,
        "sampling_mask_max_tokens": engine.config.sampling_mask_max_tokens,
        "stored_copy_rows": engine.scheduler.model.stored_rows,  # resolved: 0 where the measurement kept none
        "max_req_input_len": engine.context_length - 1,
        "startup_time": engine.started,
        "internal_states": [{**engine.scheduler.load(), **engine.scheduler.stats}],
        "version": "0.5.23",
        "frontend": "python",
        "engine": "inverted-embedded",
        **_lora_info(engine),
    }


def _lora_info(engine: Engine) -> dict[str, Any]:
    adapters = engine.scheduler.adapters
    if adapters is None:
        return {"enable_lora": False}
    return {
        "enable_lora": True,
        "max_lora_rank": adapters.max_rank,
        "lora_target_modules": list(adapters.modules),
        "max_loras_per_batch": adapters.max_per_batch,
        "max_loaded_loras": adapters.max_loaded,
        "loaded_lora_adapters": adapters.names(),
    }


def _add_info_routes(app: FastAPI) -> None:
    auth = [Depends(_require_key)]

    @app.get("/health")
    async def health(engine: EngineDep) -> Response:
        return Response(status_code=200 if engine.scheduler.alive else 503)

    @app.get("/health_generate")
    async def health_generate(engine: EngineDep) -> Response:
        if not engine.scheduler.alive:
            return Response(status_code=503)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        probe = EngineRequest(
            rid=f"HEALTH_CHECK_{new_rid()}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
            notify=lambda r, n: loop.call_soon_threadsafe(done.set) if r.finished else None,
        )
        engine.scheduler.submit(probe)
        try:
            await asyncio.wait_for(done.wait(), HEALTH_CHECK_TIMEOUT)
        except TimeoutError:
            engine.scheduler.call(lambda: engine.scheduler.abort(probe.rid))
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready(engine: EngineDep) -> Response:
        return Response(status_code=200 if engine.scheduler.alive and engine.scheduler.paused is None else 503)

    @app.get("/", dependencies=auth)
    async def root() -> PlainTextResponse:
        return PlainTextResponse("SGLang is running")

    @app.get("/model_info", dependencies=auth)
    @app.get("/get_model_info", dependencies=auth)
    async def model_info(engine: EngineDep) -> JSONResponse:
        return JSONResponse(_model_info(engine))

    @app.get("/server_info", dependencies=auth)
    @app.get("/get_server_info", dependencies=auth)
    async def server_info(engine: EngineDep) -> JSONResponse:
        return JSONResponse(_server_info(engine))

    @app.get("/get_load", dependencies=auth)  # gone from SGLang 0.5.23 (/v1/loads); sgl-router 0.3.2 still asks
    async def get_load(engine: EngineDep) -> JSONResponse:
        return JSONResponse([{"dp_rank": 0, **engine.scheduler.load(), "num_pending_tokens": 0, "ts_tic": time.time()}])

    @app.get("/v1/loads", dependencies=auth)
    async def loads(engine: EngineDep) -> JSONResponse:
        """SGLang's load report, with the fields this engine has."""
        load = engine.scheduler.load()
        return JSONResponse(
            {
                "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "loads": [
                    {
                        "timestamp": time.time(),
                        "dp_rank": 0,
                        "num_running_reqs": load["num_running_reqs"],
                        "num_waiting_reqs": load["num_waiting_reqs"],
                        "num_used_tokens": load["num_tokens"],
                    }
                ],
            }
        )

    @app.get("/v1/models", dependencies=auth)
    async def models(engine: EngineDep) -> JSONResponse:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": engine.model_name,
                        "object": "model",
                        "created": int(engine.started),
                        "owned_by": "sglang",
                        "root": engine.model_name,
                        "parent": None,
                        "max_model_len": engine.context_length,
                    }
                ],
            }
        )

    @app.get("/metrics")
    async def metrics(engine: EngineDep) -> PlainTextResponse:
        load, stats = engine.scheduler.load(), engine.scheduler.stats
        lines = [
            f"sglang:num_running_reqs {load['num_running_reqs']}",
            f"sglang:num_queue_reqs {load['num_waiting_reqs']}",
            f"sglang:num_requests_total {stats['requests_total']}",
            f"sglang:prompt_tokens_total {stats['prompt_tokens']}",
            f"sglang:generation_tokens_total {stats['generated_tokens']}",
            f"sglang:cached_tokens_total {stats['cached_tokens']}",
            f"sglang:num_aborted_requests_total {stats['requests_aborted']}",
            f"inverted:weight_update_sessions_expired_total {stats['weight_update_sessions_expired']}",
            f"inverted:prefill_tokens_total {stats['prefill_tokens']}",  # the prompt tokens it computed
            f"inverted:prefill_seconds_total {stats['prefill_seconds']:.3f}",
            f"inverted:decode_seconds_total {stats['decode_seconds']:.3f}",
            f"inverted:decode_steps_total {stats['decode_steps']}",
            f"inverted:weight_loads_total {stats['weight_loads']}",
            f"inverted:weight_receive_seconds_total {stats['weight_receive_seconds']:.6f}",
            f"inverted:weight_decode_seconds_total {stats['weight_decode_seconds']:.6f}",
            f"inverted:weight_copy_seconds_total {stats['weight_copy_seconds']:.6f}",
            f"inverted:grammars_compiled_total {engine._grammars.compiles if engine._grammars else 0}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")
