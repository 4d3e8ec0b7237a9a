"""The HTTP server: one FastAPI app over an `AsyncEngine`, assembled from one router per
API surface, each over the shared generation core (`flare.server.generation`):
OpenAI chat/completions and models (`flare.server.openai.routes`), Anthropic Messages
(`flare.server.anthropic`), OpenAI Responses (`flare.server.responses`), sessions
(`flare.server.sessions`) and the web chat (`flare.server.web`). This module adds the
middleware (limits, JSON bodies), the error handlers, and GET /health,
GET /metrics (Prometheus text: engine counters and gauges, request histograms
`flare.server.metrics`), GET /debug/state (engine stats as JSON), GET /v1/loads (the load a
gateway such as smg polls, `flare.server.loads`), GET / (the web chat) and
GET /docs (Swagger UI), both from vendored files (`flare.server.web`).

Policies:
- Context length (case api-context-overflow): a prompt of `max_seq_len` tokens or more is
  refused with 400 `context_length_exceeded`, naming the prompt's tokens and the limit. The
  prompt is never cut.
- max_tokens (case api-max-tokens-edge): when prompt + max_tokens exceeds `max_seq_len`,
  max_tokens is clamped to what remains, so generation ends with `finish_reason: "length"`
  at the limit and never writes past the planned sequence length. A request without
  max_tokens (or max_completion_tokens) may use everything that remains.
- n > 1: one engine request per choice (request id suffixed "-i"; with seed s, choice i
  uses seed s + i), their streams merged.
- Errors use OpenAI's body `{"error": {message, type, param, code}}`: 400 for invalid JSON
  or parameters, 404 `model_not_found`, 500 for engine failures and anything unexpected;
  the server keeps serving after any of them. In a stream that has begun, a failure is an
  error event followed by `[DONE]`.
- A client that disconnects stops its requests: the engine streams are closed, which
  aborts them in the engine and frees their pages.
- Tools and structured output (docs/agents.md): tools are rendered by `flare.server.chat`,
  the reply parsed by the served `ToolFormat` (`ServerSettings.tool_parser`); tool_choice
  required / named and response_format are enforced by an llguidance grammar per choice
  (`flare.server.grammar`), compiled off the event loop; a schema it cannot enforce is a
  400 naming the field.
- Limits (`flare.server.guard`, docs/operations.md): API key, body size (413), queue
  length (429), messages per request (400), a per-request timeout (504, or an error event
  in a stream that has begun). Rendering and tokenizing a prompt run in a worker thread,
  so a huge prompt does not stall the event loop (other streams keep flowing).
- Every final response (and the last stream chunk) carries the `flare` extension object:
  per choice, request id, server-clock timings and reuse outcome (docs/api-extensions.md).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from flare.server.anthropic.routes import messages_router
from flare.server.api_error import ApiError, error_body, validation_error
from flare.server.generation import (GenerationCore)
from flare.server.guard import (RequestGuard, ServerCounters)
from flare.server.json_body import JsonContentType
from flare.server.metrics import RequestMetrics, build_labels
from flare.server.loads import loads_router
from flare.server.openai.routes import openai_router
from flare.server.responses import responses_router
from flare.server.sessions import sessions_router
from flare.server.tool_formats import TOOL_PARSERS
from flare.server.web import mount_web

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """Server options (`flare serve` flags).

    Attributes:
        served_model_name: the model id in /v1/models and accepted in requests; defaults to
            the package's model name. The package's own model name and its package_id are
            always accepted too.
        max_n: most choices (`n`) per request.
        tool_parser: the tool-call format: "hermes", "llama3_json", or "auto" (from the
            chat template; hermes when it has no tool markup, which matches Flare's
            fallback prompt).
        api_key: bearer token required on every /v1 route (None: open). See
            `flare.server.guard`.
        protect_metrics: require the key on /metrics and /debug/state too.
        max_body_bytes: largest request body accepted (413 beyond).
        max_queue: most requests waiting for the engine before new ones get 429.
        max_messages: most messages in one chat request (400 beyond).
        request_timeout_s: seconds from a request's arrival after which it is aborted
            (504, or an error event in a stream); None: no limit.
        header_timeout_s: seconds a request's headers may take to arrive (408 and the
            connection closed beyond; `flare.server.connection`).
        body_timeout_s: seconds a request's body may take to arrive in full, from its
            headers (408 and the connection closed beyond; None: no limit).
    """

    served_model_name: str | None = None
    max_n: int = 8
    tool_parser: str = "auto"
    api_key: str | None = None
    protect_metrics: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    max_queue: int = 256
    max_messages: int = 2048
    request_timeout_s: float | None = None
    header_timeout_s: float = 10.0
    body_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        if self.max_messages < 1:
            raise ValueError(f"max_messages must be at least 1, got {self.max_messages}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be positive seconds, got "
                             f"{self.request_timeout_s}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive seconds, got {value}")
        if self.tool_parser not in ("auto", *TOOL_PARSERS):
            raise ValueError(f"unknown tool parser {self.tool_parser!r}; expected one of "
                             f"auto, {', '.join(TOOL_PARSERS)}")


# --------------------------------------------------------------------------- metrics

_KNOWN_METRICS = {
    "pages_used": "KV pages held by sequences",
    "pages_free": "KV pages free in the pool",
    "pages_total": "KV pages in the pool (from the capacity plan)",
    "num_running": "sequences running (holding pages)",
    "num_waiting": "sequences waiting for admission",
    "prompt_tokens_total": "prompt tokens received",
    "generation_tokens_total": "completion tokens generated",
    "requests_finished_total": "requests finished (stop or length)",
}


_GAUGES = {"pages_total"}  # ends in "_total" but is a capacity, not a count of events
_COUNTERS = {"num_preemptions"}  # only ever goes up


class _EngineCollector(Collector):
    """Reads `engine.stats()` at scrape time: no copy of engine state to keep in step.

    Keys ending in "_total" become counters (exposed as `flare_<key>`), others gauges (with
    the exceptions in `_GAUGES` / `_COUNTERS`); keys the engine adds later are exported the
    same way.
    """

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Metric]:
        for key, value in self._engine.stats().items():
            if not isinstance(value, (int, float)):
                continue
            doc = _KNOWN_METRICS.get(key, key.replace("_", " "))
            if key in _COUNTERS or (key.endswith("_total") and key not in _GAUGES):
                yield CounterMetricFamily(f"flare_{key.removesuffix('_total')}", doc, value=value)
            else:
                yield GaugeMetricFamily(f"flare_{key}", doc, value=value)


# --------------------------------------------------------------------------- the app


def create_app(
    engine: Any, settings: ServerSettings | None = None, *, owns_engine: bool = False,
    manifest: Any = None,
) -> FastAPI:
    """The FastAPI app serving `engine` (an `AsyncEngine`).

    Args:
        engine: the `flare.runtime.async_engine.AsyncEngine` to serve.
        settings: server options; defaults to `ServerSettings()`.
        owns_engine: shut the engine down when the app shuts down.
        manifest: the served package's manifest, for `flare_build_info` (None: unknown).
    """
    settings = settings or ServerSettings()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    counters = ServerCounters()
    registry.register(counters)
    core = GenerationCore(engine, settings, counters)  # shared by every API surface
    core.metrics = RequestMetrics(registry, engine.plan.max_seq_len,
                                  build_labels(manifest, engine.package_id))
    tool_format = core.tool_format

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await engine.shutdown()

    app = FastAPI(title="Flare", lifespan=lifespan, docs_url=None, redoc_url=None)
    mount_web(app, core)  # GET / (web chat), /web/ assets, /docs from vendored files
    app.add_middleware(RequestGuard, api_key=settings.api_key,
                       max_body_bytes=settings.max_body_bytes,
                       protect_metrics=settings.protect_metrics,
                       queue_length=lambda: (engine.num_waiting if hasattr(engine, "num_waiting")
                                             else engine.stats().get("num_waiting", 0)),
                       max_queue=settings.max_queue, counters=counters,
                       body_timeout_s=settings.body_timeout_s)
    app.add_middleware(JsonContentType)  # JSON bodies sent without the JSON type
    app.state.engine = engine
    app.include_router(sessions_router(engine))
    app.include_router(responses_router(engine, core, settings))  # /v1/responses
    app.include_router(messages_router(core))  # /v1/messages (Anthropic)
    app.state.settings = settings
    app.state.registry = registry
    app.state.tool_format = tool_format

    # ---- errors ---------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())  # OpenAI answers invalid parameters with 400
        return JSONResponse(err.body(), status_code=err.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(str(exc.detail), code=code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error", type="server_error"),
                            status_code=500)

    app.include_router(openai_router(engine, core, settings))  # chat, completions, models
    app.include_router(loads_router(engine))  # /v1/loads, for a gateway's load-aware routing

    @app.get("/health")
    async def health() -> dict[str, str]:
        # serving goes on without an unreachable Redis tier (recompute): 200, "degraded"
        remote = getattr(getattr(engine, "engine", None), "remote_tier", None)
        if remote is not None and not remote.up:
            return {"status": "degraded", "remote_tier": "down"}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        return dict(engine.stats())

    return app


def serve(package_path: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", *, prefix_cache: bool = True,
          shutdown_timeout_s: float = 10.0, state_dir: str | None = None,
          restore_cost_factor: float = 0.5, save_state_on_shutdown: bool = False,
          write_through: bool = True,
          max_pinned_pages: int | None = None, threads: int | None = None,
          device: str = "cpu", cuda_graphs: bool = True, remote_tier: Any = None,
          **settings: Any) -> None:
    """Load a runtime package and serve it until interrupted (blocks).

    `engine_from_package` (load_package -> Engine.from_package) -> `freeze_startup_objects`
    -> AsyncEngine (inside uvicorn's event loop, which it needs) -> uvicorn. The engine is
    stopped when the server exits.

    Args:
        package_path: folder of a runtime package written by `flare prepare`.
        host, port: where to listen.
        log_level: uvicorn's log level.
        prefix_cache: reuse cached KV pages across requests (the engine's prefix index).
        shutdown_timeout_s: on SIGTERM/SIGINT, how long in-flight requests may run before
            their connections are closed (which aborts them in the engine); then exit 0.
        state_dir: folder of the disk tier of conversation states (None: no disk tier);
            states there survive a restart and are offered to this package only.
        restore_cost_factor: restore from host/disk only when the estimated transfer time
            is below this factor x the estimated prefill time it saves (speeds measured by
            prepare, manifest tuning).
        save_state_on_shutdown: at exit, write every cached state to the disk tier.
        write_through: with a disk tier, write finished and evicted states to it in the
            background, so a killed server restarts with them (False:
            `--no-write-through`).
        max_pinned_pages: most KV pages named sessions may pin (None: a quarter of the pool).
        threads: torch intra-op threads (None: `serving_threads` of the package's tuning).
        device: "cpu" or "cuda[:N]"; the package must have been prepared for its class.
        cuda_graphs: on CUDA, capture and replay the package's graph plan (False: decode
            eagerly, `--no-cuda-graphs`).
        remote_tier: a `flare.state.remote_tier.RemoteTierConfig`: the Redis tier shared
            by replicas, in the disk tier's place (None: none; docs/scale-out.md).
        **settings: `ServerSettings` fields.

    Raises:
        TypeError: an unknown setting.
        Whatever `load_package` raises for a package this build cannot serve.
    """
    import uvicorn

    from flare.runtime.async_engine import AsyncEngine
    from flare.server.connection import uvicorn_config
    from flare.runtime.boot import engine_from_package, freeze_startup_objects

    server_settings = ServerSettings(**settings)
    package, engine = engine_from_package(
        package_path, device=device, threads=threads,
        restore_cost_factor=restore_cost_factor, cuda_graphs=cuda_graphs,
        save_state_on_shutdown=save_state_on_shutdown, prefix_cache=prefix_cache,
        write_through=write_through,
        state_dir=state_dir, max_pinned_pages=max_pinned_pages, remote_tier=remote_tier)
    freeze_startup_objects()  # the engine's objects live as long as the server

    async def main() -> None:
        async_engine = AsyncEngine(engine, model_name=package.manifest.model_name,
                                   package_id=package.manifest.package_id)
        app = create_app(async_engine, server_settings, owns_engine=True,
                         manifest=package.manifest)
        config = uvicorn_config(app, host=host, port=port, log_level=log_level,
                                header_timeout_s=server_settings.header_timeout_s,
                                timeout_graceful_shutdown=shutdown_timeout_s)
        await uvicorn.Server(config).serve()

    # uvicorn handles SIGTERM itself, then re-raises it into the handler that was installed
    # before it started; a no-op handler there makes a graceful shutdown exit with status 0
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    asyncio.run(main())
