"""``inverted view``'s web app (``create_app``): three pages over a ``RunIndex``, read-only.

- ``/``: the run: reward, evaluation and pass-rate curves, per-phase times, throughput, the
  train/rollout log-prob mismatch and the weight version, against step; it polls for new rows.
- ``/samples``: the Samples table, filtered, sorted and paged by the server (``/api/samples``).
- ``/trajectory?group=G&index=I&branch=B``: one Sample token by token (``/api/trajectory``).

The pages are static HTML and JavaScript (``static/``); the curves are drawn by Plotly, served
from the ``plotly`` package's own copy (no network at run time). Every JSON route first takes in
what the job wrote since the last refresh (at most once a second, on a worker thread: parsing
Samples is CPU work). With a key, a page opened once with ``?key=KEY`` keeps it in a cookie
(HttpOnly, SameSite=Strict) and drops it from the address; API callers may send it as a bearer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Literal

import orjson
import yaml
from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from inverted.auth import NO_DOCS, key_matches, presented_key
from inverted.hf_checkpoint import ModelSpec, load_tokenizer
from inverted.processes import UVICORN_OPTIONS
from inverted.view.config import ViewConfig
from inverted.view.index import SORTABLE, STATUSES, RunIndex, SampleQuery

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PAGES = {"/": "run.html", "/samples": "samples.html", "/trajectory": "trajectory.html"}
COOKIE = "inverted_view_key"
REFRESH_S = 1.0


def plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class SamplesParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step_min: int | None = None
    step_max: int | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    length_min: int | None = Field(default=None, ge=0)
    length_max: int | None = Field(default=None, ge=0)
    staleness_min: int | None = None
    mismatch_min: float | None = None
    group: int | None = None
    status: list[Literal[STATUSES]] | None = None  # type: ignore[valid-type]
    zero_variance: bool = False
    sort: Literal[tuple(sorted(SORTABLE))] = "group_index"  # type: ignore[valid-type]
    descending: bool = False
    page: int = Field(default=0, ge=0, le=10_000_000)
    page_size: int = Field(default=50, ge=1, le=500)


class Refresher:
    """``index.refresh`` off the event loop, at most once per ``REFRESH_S``; callers in between share it."""

    def __init__(self, index: RunIndex) -> None:
        self.index, self._lock, self._last = index, asyncio.Lock(), 0.0

    async def __call__(self) -> RunIndex:
        async with self._lock:
            if time.monotonic() - self._last >= REFRESH_S:
                await asyncio.to_thread(self.index.refresh)
                self._last = time.monotonic()
        return self.index


async def fresh_index(request: Request) -> RunIndex:
    """The app's index, brought up to date (at most once per ``REFRESH_S``)."""
    return await request.app.state.refresher()


Fresh = Annotated[RunIndex, Depends(fresh_index)]


def create_app(index: RunIndex, *, api_key: str | None = None, title: str = "") -> FastAPI:
    refresher = Refresher(index)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await refresher()
        yield
        index.close()

    app = FastAPI(title="inverted view", lifespan=lifespan, **NO_DOCS)
    app.state.refresher = refresher

    @app.middleware("http")
    async def require_key(request: Request, call_next):
        if not api_key or request.url.path == "/health":
            return await call_next(request)
        given = request.query_params.get("key")
        if given is not None and request.url.path in PAGES and key_matches(given, api_key):
            clean = request.url.remove_query_params("key")
            response = RedirectResponse(str(clean.path) + (f"?{clean.query}" if clean.query else ""), status_code=303)
            response.set_cookie(COOKIE, api_key, httponly=True, samesite="strict")
            return response
        if key_matches(presented_key(request), api_key) or key_matches(request.cookies.get(COOKIE), api_key):
            return await call_next(request)
        return JSONResponse(
            {
                "error": {
                    "message": "this viewer needs its key: open it once with ?key=KEY",
                    "type": "invalid_request_error",
                    "code": "invalid_api_key",
                }
            },
            status_code=401,
        )

    def page(name: str):
        async def serve() -> FileResponse:
            return FileResponse(STATIC / name, headers={"cache-control": "no-cache"})

        return serve

    for path, name in PAGES.items():
        app.get(path, include_in_schema=False)(page(name))

    @app.get("/static/plotly.min.js", include_in_schema=False)
    async def plotly() -> FileResponse:
        return FileResponse(plotly_js(), media_type="text/javascript", headers={"cache-control": "max-age=86400"})

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> FileResponse:
        path = STATIC / name
        if name not in {p.name for p in STATIC.iterdir()}:  # only the files shipped here, never a path
            raise HTTPException(404, "no such file")
        return FileResponse(path, headers={"cache-control": "no-cache"})

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/run")
    async def run(idx: Fresh) -> dict[str, Any]:
        return {"title": title, **await asyncio.to_thread(idx.counts)}

    @app.get("/api/metrics")
    async def metrics(idx: Fresh, after: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
        rows = idx.metrics(after)
        return {"after": after, "rows": rows}

    @app.get("/api/samples")
    async def samples(idx: Fresh, params: Annotated[SamplesParams, Query()]) -> dict[str, Any]:
        return await asyncio.to_thread(idx.page, SampleQuery(**params.model_dump()))

    @app.get("/api/trajectory")
    async def trajectory(idx: Fresh, group: int, index: int, branch: int = 0) -> Response:
        found = await asyncio.to_thread(idx.trajectory, group, index, branch)
        if found is None:
            raise HTTPException(404, f"no Sample (group {group}, index {index}, branch {branch}) in this run")
        return Response(orjson.dumps(found), media_type="application/json")

    return app


def open_run(cfg: ViewConfig) -> tuple[RunIndex, str | None]:
    """The run directory's index (with the run's tokenizer and reward key) and the key that guards it."""
    run_dir = Path(cfg.run_dir)
    config = read_run_config(run_dir)
    train = config.get("train", {})
    candidates = (run_dir / "checkpoints" / "hf_config", run_dir / "hf", Path(train.get("hf_checkpoint") or "-"))
    checkpoint = cfg.tokenizer or next((str(p) for p in candidates if (p / "tokenizer_config.json").is_file()), None)
    tokenizer, experts = None, None
    if checkpoint:
        tokenizer, experts = load_tokenizer(checkpoint), experts_shape(checkpoint)
    else:
        logger.warning("%s: no tokenizer found (pass --tokenizer): tokens are shown as ids", run_dir)
    api_key = cfg.api_key or view_key(run_dir)
    return RunIndex(run_dir, reward_key=train.get("reward_key"), tokenizer=tokenizer, experts_shape=experts), api_key


def view_key(run_dir: Path) -> str | None:
    """The run's own viewer key: derived from the key the job gave its buffer (``services/buffer.yaml``,
    readable by the run's owner only), so whoever may read the run may view it, and the key a browser
    holds opens no service of a running job. None for a directory the job did not write."""
    try:
        job_key = (yaml.safe_load((run_dir / "services" / "buffer.yaml").read_text()) or {}).get("api_key")
    except (FileNotFoundError, yaml.YAMLError):
        return None
    return hmac.new(job_key.encode(), b"inverted view", hashlib.sha256).hexdigest()[:32] if job_key else None


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The job's resolved config (``config.yaml``, by section); empty when the directory has none."""
    try:
        return yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except FileNotFoundError:
        return {}


def experts_shape(checkpoint: str) -> tuple[int, int] | None:
    """(layers, experts per token) of a Mixture-of-Experts checkpoint, for its routed experts; None if dense."""
    spec = ModelSpec.from_checkpoint(checkpoint)
    return (spec.num_layers, spec.moe_top_k) if spec.is_moe else None


def serve(cfg: ViewConfig) -> None:
    import uvicorn

    index, api_key = open_run(cfg)
    url = f"http://{cfg.host}:{cfg.port}/" + (f"?key={api_key}" if api_key else "")
    print(f"inverted view: {cfg.run_dir} at {url}", flush=True)  # the key goes to its owner's console only
    uvicorn.run(
        create_app(index, api_key=api_key, title=Path(cfg.run_dir).name),
        host=cfg.host,
        port=cfg.port,
        **UVICORN_OPTIONS,
    )
