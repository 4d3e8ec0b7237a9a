"""HTTP routes of named sessions (`flare.state.sessions`; docs/api-extensions.md).

    GET    /v1/sessions/{name}        the session: tokens held, tokens saved to disk
    DELETE /v1/sessions/{name}        forget the name and unpin its state (it then ages out)
    POST   /v1/sessions/{name}/fork   {"id": NEW}: NEW starts from the same state
    POST   /v1/sessions/{name}/save   write the state to the disk tier (survives a restart)
    POST   /v1/state/offload          {"to": "host" | "disk"}: move every cached state no
                                      request uses and no session pins out of the device
                                      pools (to disk: sessions' pinned chains are copied)

Errors are OpenAI-style bodies: 400 for a bad name or body, 404 for an unknown session,
409 when a fork target exists (or the session changed during a save), 503 when the server
has no disk tier, the save was refused (too big for the disk tier, queue full), a write
failed, or the state folder cannot be written.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from flare.server.api_error import ApiError
from flare.state.sessions import SessionError
from flare.state.chain_writes import SaveRefused

SAVE_TIMEOUT_S = 120.0


def _session_error(exc: SessionError) -> ApiError:
    if exc.missing:
        return ApiError(404, str(exc), param="session", code="session_not_found")
    if "already exists" in str(exc):
        return ApiError(409, str(exc), param="id", code="session_exists")
    if exc.code == "too_many_sessions":  # the same code a chat request naming one more gets
        return ApiError(400, str(exc), param="id", code=exc.code)
    return ApiError(400, str(exc), param="session", code="invalid_session_name")


def _unwritable(exc: OSError) -> ApiError:
    return ApiError(503, f"the state folder cannot be written: {exc}", type="server_error",
                    code="state_folder_unwritable")


def _body(name: str, tokens: int, saved: int, **extra: Any) -> dict[str, Any]:
    return {"id": name, "object": "session", "tokens": tokens, "saved_tokens": saved, **extra}


def sessions_router(engine: Any) -> APIRouter:
    """Routes over an `AsyncEngine`'s session registry (`engine.engine.sessions`)."""
    router = APIRouter()

    def engine_core() -> Any:
        """The engine holding the registry (looked up per request: test doubles of the
        AsyncEngine may have none, and then sessions are simply not offered)."""
        core = getattr(engine, "engine", None)
        if core is None or not hasattr(core, "sessions"):
            raise ApiError(501, "this server does not keep sessions", type="server_error",
                           code="sessions_unsupported")
        return core

    @router.get("/v1/sessions/{name}")
    async def get_session(name: str) -> dict[str, Any]:
        core = engine_core()
        try:
            s = core.sessions.get(name)
        except SessionError as exc:
            raise _session_error(exc) from None
        return _body(name, len(s.tokens), s.saved_tokens,
                     pinned_pages=core.pins.pages_of(name))

    @router.delete("/v1/sessions/{name}")
    async def delete_session(name: str) -> dict[str, Any]:
        core = engine_core()
        try:
            await asyncio.to_thread(core.sessions.delete, name)  # rewrites the saved names
        except SessionError as exc:
            raise _session_error(exc) from None
        except OSError as exc:
            raise _unwritable(exc) from None
        await asyncio.wrap_future(core.call(lambda: core.pins.release(name)))
        return {"id": name, "object": "session.deleted", "deleted": True}

    @router.post("/v1/sessions/{name}/fork")
    async def fork_session(name: str, request: Request) -> dict[str, Any]:
        core = engine_core()
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "body must be a JSON object like {\"id\": \"new-name\"}",
                           param="id") from None
        new = body.get("id") if isinstance(body, dict) else None
        if not isinstance(new, str):
            raise ApiError(400, "'id' (the new session's name) is required", param="id")
        try:
            s = await asyncio.to_thread(core.sessions.fork, name, new)
        except SessionError as exc:
            raise _session_error(exc) from None
        except OSError as exc:
            raise _unwritable(exc) from None
        pinned = await asyncio.wrap_future(core.call(lambda: core.pins.fork(name, new)))
        return _body(new, len(s.tokens), s.saved_tokens, forked_from=name, pinned=pinned)

    @router.post("/v1/sessions/{name}/save")
    async def save_session(name: str) -> dict[str, Any]:
        core = engine_core()
        try:
            tokens = core.sessions.get(name).tokens
            ticket, covered = await asyncio.wrap_future(core.call(lambda: core.save_session(name)))
        except SessionError as exc:
            raise _session_error(exc) from None
        except SaveRefused as exc:
            raise ApiError(503, f"saving session {name!r} failed: {exc}", type="server_error",
                           code="save_failed") from None
        except ValueError as exc:
            raise ApiError(503, str(exc), type="server_error", code="no_disk_tier") from None
        if ticket is not None:
            done = await asyncio.to_thread(ticket.done.wait, SAVE_TIMEOUT_S)
            if not done or ticket.error or ticket.written < len(ticket.keys):
                raise ApiError(503, f"saving session {name!r} failed: "
                                    f"{ticket.error or 'the disk tier refused a record'}",
                               type="server_error", code="save_failed")
        try:
            marked = await asyncio.to_thread(core.sessions.mark_saved, name, tokens, covered)
        except OSError as exc:
            raise _unwritable(exc) from None
        if not marked:  # deleted, or moved on to another state, while it was written
            raise ApiError(409, f"session {name!r} was deleted or changed during the save; "
                                f"its state was written but not marked saved",
                           code="session_changed")
        return _body(name, len(tokens), covered,
                     records_written=ticket.written if ticket is not None else 0)

    @router.post("/v1/state/offload")
    async def offload_state(request: Request) -> dict[str, Any]:
        """Move every cached state no request uses and no session pins out of the device
        pools: to the host tier (`{"to": "host"}`, the default) or on to disk (`{"to":
        "disk"}`: waits for the writes; before a planned restart, so the next server
        restores from disk). Pinned session chains stay on the device (a pin keeps a
        session's next turn there); to disk, each named session's whole chain is also
        written and the session marked saved, as `--save-state-on-shutdown` does, so
        nothing the device holds is left off the disk."""
        core = engine_core()
        try:
            body = await request.json() if await request.body() else {}
        except ValueError:
            raise ApiError(400, "body must be a JSON object like {\"to\": \"disk\"}",
                           param="to") from None
        to = body.get("to", "host") if isinstance(body, dict) else None
        if to not in ("host", "disk"):
            raise ApiError(400, f"'to' must be \"host\" or \"disk\", got {to!r}", param="to")
        if core.tiers is None or (to == "disk" and core.tiers.transfers is None):
            raise ApiError(503, f"this server has no {to} tier", type="server_error",
                           code=f"no_{to}_tier")
        pages = await asyncio.wrap_future(core.call(core.offload))
        written = sessions = 0
        if to == "disk":
            stats = core.tiers.transfers.stats
            before = stats.records_written
            saves = await asyncio.wrap_future(core.call(core.start_session_saves))
            await asyncio.wrap_future(core.call(lambda: core.tiers.flush(0)))
            await asyncio.to_thread(core.tiers.transfers.wait_idle, SAVE_TIMEOUT_S)
            try:
                sessions = await asyncio.to_thread(core.finish_session_saves, saves,
                                                   SAVE_TIMEOUT_S)
            except OSError as exc:
                raise _unwritable(exc) from None
            written = stats.records_written - before  # written now, not merely handed over
        return {"object": "state.offload", "to": to, "pages_released": pages,
                "records_written": written, "sessions_saved": sessions}

    return router
