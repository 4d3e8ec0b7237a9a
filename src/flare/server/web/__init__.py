"""The web chat page and the offline API docs, served from files inside the package.

    GET /                 the chat page (static/index.html)
    GET /web/...          its script, style sheet and vendored libraries (static/)
    GET /docs             Swagger UI over /openapi.json, from vendored swagger-ui-dist
    POST /api/web/continuation  {"messages": [...], "partial": TEXT}: the prompt token ids
                          of an answer to continue (the page's Continue button)

Nothing is fetched from a CDN: every asset lies in `flare/server/web/static/` (the
libraries, with their licenses, in `static/vendor/`, see its README.txt), so the page and
/docs work on a machine without internet. The page is a client of the public API only:
/v1/chat/completions (streamed, with a `session`), /v1/sessions/* (branches are forks),
/v1/models and /debug/state (the status view), plus one helper: Continue needs the
prompt as the model saw it, the conversation rendered by the chat template with the
assistant header and the stopped answer's text after it. `/api/web/continuation` returns
those token ids, and the page sends them to /v1/completions with the same session, so the
stopped answer's state is reused and generation goes on where it stopped. The page, its
files and /docs need no API key (the guard leaves them open); the API calls the page makes
(that helper included) do, and the page asks for the key once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field

from flare.server.api_error import ApiError
from flare.server.openai.messages import ChatMessage

STATIC = Path(__file__).with_name("static")
ASSETS_PREFIX = "/web"
SWAGGER = f"{ASSETS_PREFIX}/vendor/swagger-ui"


class ContinuationRequest(BaseModel):
    """Body of POST /api/web/continuation."""

    messages: list[ChatMessage] = Field(min_length=1)
    partial: str = ""


def mount_web(app: FastAPI, core: Any) -> None:
    """Serve the chat page at `/`, its assets under `/web/`, and Swagger UI at `/docs`
    on `app` (create it with `docs_url=None, redoc_url=None`: FastAPI's own /docs loads
    its scripts from a CDN, and /redoc has no vendored bundle). `core` is the app's
    `flare.server.generation.GenerationCore` (the continuation helper renders with it).

    Raises:
        RuntimeError: the package was installed without its static files.
    """
    if not (STATIC / "index.html").is_file():
        raise RuntimeError(f"the web chat's files are missing from {STATIC}: the package "
                           f"was installed without its package data")
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def index() -> FileResponse:
        # no-cache: the page and its script change together with the server
        return FileResponse(STATIC / "index.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{SWAGGER}/swagger-ui-bundle.js",
            swagger_css_url=f"{SWAGGER}/swagger-ui.css",
            swagger_favicon_url=f"{SWAGGER}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None})  # no call to validator.swagger.io

    @router.post("/api/web/continuation")
    async def continuation(body: ContinuationRequest) -> dict[str, Any]:
        """Token ids of `messages` rendered with the assistant header, then `partial`
        (the stopped answer) encoded without special tokens."""
        core.prompt_bound.check(sum(len(m.content or "") for m in body.messages)
                                + len(body.partial), "messages")
        ids = await core.chat_prompt_ids(body.messages, None)
        if body.partial:
            try:
                ids += await asyncio.to_thread(core.engine.tokenizer.encode, body.partial,
                                               add_special_tokens=False)
            except (TypeError, UnicodeError) as e:
                raise ApiError(400, f"partial text cannot be encoded: {e}",
                               param="partial") from e
        return {"object": "web.continuation", "prompt_token_ids": list(ids),
                "num_tokens": len(ids)}

    app.include_router(router)
    app.mount(ASSETS_PREFIX, StaticFiles(directory=STATIC), name="web")
