"""OpenAI's Responses API over the generation core (docs/agents.md, "Responses API").

    POST   /v1/responses        create a response (streamed with `"stream": true`)
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}   forget it, and its session

Requests and input items: `flare.server.responses_protocol`; the response object and its
stream events: `flare.server.responses_events`; stored records:
`flare.server.response_store`. Generation,
grammars, tool parsing and the context policy are the chat surface's
(`flare.server.generation`).

Stored responses (`store`, default true) are Flare sessions (`flare.state.sessions`): the
response id names the session, so its state is pinned on the device within the pinned-page
budget (`--max-pinned-pages`), saved to the disk tier as soon as it is complete (with a
`--state-dir`), and found again after a restart. The record of each stored response (the
public object, the conversation as chat messages, its exact text and token ids: prompt
plus every generated token; `flare.server.response_store`) is kept in memory and, with a
disk tier, in one JSON file per response under `responses-<package>/` in the state folder
(written atomically; at most `MAX_STORED_RESPONSES`, the oldest forgotten first). With a
remote tier (`--remote-tier`) each record is also published in Redis
(`flare.state.remote_responses`), so a
`previous_response_id` that a gateway sends to another replica is found there, and its
state restored from the remote tier by its tokens.

`previous_response_id`: the request sends only its new items. The conversation is the
stored one plus those items, rendered by the model's chat template; when that rendering
starts with the stored conversation's text (the template reproduces the model's own
output: ChatML and the other common templates do), the prompt is the stored token ids
followed by the tokens of the new text only, so the stored state is continued exactly and
reused whole (`usage.input_tokens_details.cached_tokens`). Otherwise (other
`instructions` or tools, a template that rewrites earlier turns) the whole conversation is
re-rendered and the prefix cache reuses what still matches; `flare.continuation` in the
response says which ("exact" or "rerendered"). Two requests naming the same response
branch from it: states are copied on write, nothing one branch writes reaches the other.
Only the newest response of a chain keeps the pin (its pages hold every earlier turn), so
a long agent loop does not pin one copy per turn. A response whose state does not fit in
the pinned budget is still stored, unpinned: it is then cached, demoted and restored like
any other state, and recomputed when nothing holds it any more.

A forced structure (`text.format`, a forced tool call) whose grammar fails mid-generation
ends the response as `failed` with error code "grammar_error" and the output so far
(`response.failed` when streamed); it is not stored, so it cannot be continued from.

`instructions` left out of a continuation keep the stored ones (OpenAI drops them; keeping
them is what lets the state continue exactly); new instructions replace them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flare.runtime.request import RequestRejected
from flare.runtime.request import GenerationRequest, SamplingParams
from flare.server.api_error import ApiError
from flare.server.chat import ChatTemplateError, render_chat
from flare.server.generation import (FORCED_MODES, SSE_HEADERS, ClosingStreamingResponse,
                                     GenerationCore, new_id)
from flare.server.grammar import grammar_failure_message
from flare.server.guard import check_message_count, unencodable_text
from flare.server.response_store import RESPONSE_ID_PATTERN, ResponseStore, StoredResponse
from flare.server.responses_events import ResponseEvents, sse_bytes, usage_object
from flare.server.responses_protocol import (
    ResponsesRequest,
    call_ids,
    input_messages,
    output_messages,
    responses_param,
)
from flare.server.streaming import Tally, flare_extension
from flare.server.tool_calls import ContentEvent, Event
from flare.state.remote_responses import RemoteResponses

log = logging.getLogger(__name__)

SAVE_TIMEOUT_S = 120.0


def continuation_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None, tool_format: Any,
                        parent: StoredResponse | None) -> tuple[str, list[int], str | None]:
    """The prompt of a request: (text, token ids, continuation).

    Without `parent`: the rendered conversation, tokenized (continuation None). With it:
    when the rendering starts with the parent's exact text, the parent's token ids plus the
    tokens of the rest ("exact"); else the whole rendering tokenized ("rerendered").

    Raises:
        ChatTemplateError: as `render_chat`.
    """
    text = render_chat(tokenizer, messages, tools, tool_format)
    if parent is not None and text.startswith(parent.text):
        rest = text[len(parent.text):]
        return text, parent.tokens + list(tokenizer.encode(rest, add_special_tokens=False)), \
            "exact"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return text, ids, None if parent is None else "rerendered"


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found")


def responses_router(engine: Any, gen: GenerationCore, settings: Any) -> APIRouter:
    """The Responses API routes over `engine` (an `AsyncEngine`), the shared core and the
    `ServerSettings`."""
    router = APIRouter()
    core = getattr(engine, "engine", None)  # the Engine: sessions, pins, tiers
    has_sessions = core is not None and hasattr(core, "sessions") and hasattr(core, "pins")
    folder = None
    if has_sessions and getattr(core.sessions, "path", None) is not None:
        digest = core.sessions.namespace[:16] or "default"
        folder = core.sessions.path.parent / f"responses-{digest}"
    remote = getattr(core, "remote_tier", None)
    store = ResponseStore(folder, shared=None if remote is None else RemoteResponses(remote))
    background: set[asyncio.Task] = set()
    tokenizer = engine.tokenizer

    # ---- sessions -----------------------------------------------------------------------

    async def on_engine(fn: Any) -> Any:
        return await asyncio.wrap_future(core.call(fn))

    async def save(name: str) -> None:
        """Write a stored response's state to the disk tier and mark its session saved."""
        tiers = getattr(core, "tiers", None)
        if tiers is None or tiers.transfers is None:
            return
        try:
            tokens = core.sessions.get(name).tokens
            ticket, covered = await on_engine(lambda: core.save_session(name))
            if ticket is not None:
                done = await asyncio.to_thread(ticket.done.wait, SAVE_TIMEOUT_S)
                if not done or ticket.error or ticket.written < len(ticket.keys):
                    log.warning("saving response %s to disk failed: %s", name,
                                ticket.error or "the disk tier refused a record")
                    return
            await asyncio.to_thread(core.sessions.mark_saved, name, tokens, covered)
        except Exception as exc:  # a failed save costs a recompute later, never the answer
            log.warning("saving response %s to disk failed: %s", name, exc)

    async def forget_session(name: str) -> None:
        if not has_sessions:
            return
        try:
            await asyncio.to_thread(core.sessions.delete, name)
        except Exception:  # noqa: BLE001 - no such session (never recorded): nothing to do
            pass
        await on_engine(lambda: core.pins.release(name))

    async def forget_deleted(response_id: str) -> None:
        """Unpin a response another replica deleted (its record is gone; its pin here, if
        this replica served it, would otherwise hold pages for nobody)."""
        if store.shared is not None and RESPONSE_ID_PATTERN.fullmatch(response_id):
            await forget_session(response_id)

    async def keep(rec: StoredResponse, parent_id: str | None, session: str | None) -> None:
        """Store `rec`; move the chain's pin to it; save its state to disk."""
        for old in await asyncio.to_thread(store.put, rec):
            await forget_session(old)
        if session is None:
            return
        if parent_id is not None:  # the new pin's pages hold the parent's state
            await on_engine(lambda: core.pins.release(parent_id))
        task = asyncio.create_task(save(session))
        background.add(task)
        task.add_done_callback(background.discard)

    # ---- routes -------------------------------------------------------------------------

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's POST /v1/responses (module docstring)."""
        arrival_ns = time.monotonic_ns()
        gen.check_model(body.model)
        parent = None
        if body.previous_response_id is not None:
            parent = await asyncio.to_thread(store.get, body.previous_response_id)
            if parent is None:
                await forget_deleted(body.previous_response_id)
                raise _not_found(body.previous_response_id, "previous_response_id")
        history = parent.messages if parent is not None else []
        new, origin = input_messages(body.input, known_calls=call_ids(history))
        instructions = body.instructions if body.instructions is not None else (
            parent.instructions if parent is not None else None)
        head = [{"role": "system", "content": instructions}] if instructions else []
        messages = head + history + new
        check_message_count(len(messages), settings.max_messages)
        gen.prompt_bound.check(sum(len(m.get("content") or "") for m in head + new), "input")
        tools = body.chat_tools()

        def param_of(index: int | None) -> str:
            if index is None:
                return "input"
            if index < len(head):
                return "instructions"
            if index < len(head) + len(history):
                return "previous_response_id"
            return f"input[{origin[index - len(head) - len(history)]}]"

        try:
            text, prompt_ids, continuation = await asyncio.to_thread(
                continuation_prompt, tokenizer, messages, tools, gen.tool_format, parent)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param=param_of(e.message_index),
                           code="invalid_chat_template_input") from e
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate escape
            raise unencodable_text("input") from e

        max_tokens = gen.completion_budget(body.max_output_tokens, len(prompt_ids), "input")
        mode = body.tool_mode
        specs = ([(t.name, t.parameters, t.strict is not False) for t in body.tools or ()]
                 if tools else [])
        parallel = body.parallel_tool_calls is not False
        try:
            constraints = await gen.constraints(specs, mode, only=body.forced_tool_name,
                                                parallel=parallel, answer=body.answer_schema,
                                                n=1)
        except ApiError as e:
            e.param = responses_param(e.param)
            raise
        make_parser = (gen.parser_factory([t.name for t in body.tools or ()],
                                          None if parallel else 1,
                                          strict=mode in FORCED_MODES) if tools else None)

        response_id = new_id("resp", "_")
        session = None
        if body.store and has_sessions and core.sessions.has_room(response_id):
            session = response_id
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p)
        constraint = constraints[0] if constraints else None
        outputs = gen.generate([GenerationRequest(
            request_id=f"{response_id}-0", prompt_token_ids=prompt_ids, params=params,
            arrival_ns=arrival_ns, constraint=constraint, session=session)], arrival_ns)
        generated: list[int] = []

        async def tracked() -> Any:
            try:
                async for index, out in outputs:
                    generated.extend(out.token_ids)
                    yield index, out
            finally:
                await outputs.aclose()

        stream = tracked()
        events = ResponseEvents({
            "id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "instructions": instructions,
            "max_output_tokens": body.max_output_tokens, "model": gen.served_name,
            "output": [], "parallel_tool_calls": parallel,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store,
            "temperature": params.temperature, "text": body.echo_text(),
            "tool_choice": body.echo_tool_choice(), "tools": body.echo_tools(),
            "top_p": params.top_p, "truncation": "disabled", "usage": None, "user": None,
            "metadata": body.metadata or {}})

        async def finish(tally: Tally, reason: str | None) -> list[dict[str, Any]]:
            """The closing events (`reason`: the settled finish reason, see
            `ToolCallParser.finish_reason`); the response is stored before they are sent."""
            c = tally.choices[0]
            usage = usage_object(c.num_prompt_tokens, c.num_completion_tokens,
                                 c.num_cached_tokens)
            flare = {**flare_extension(tally), "continuation": continuation}
            error = ({"code": "grammar_error", "message": grammar_failure_message(constraint)}
                     if reason == "grammar_error" else None)
            final = events.finish(reason == "length", usage, {"flare": flare}, error)
            if error is not None and session is not None:
                await forget_session(session)  # a failed answer is never continued from
            elif body.store:
                done = events.response
                rec = StoredResponse(
                    id=response_id, body=done, instructions=instructions,
                    messages=history + new + output_messages(done["output"]),
                    text=text + tokenizer.decode(generated, skip_special_tokens=False,
                                                 clean_up_tokenization_spaces=False),
                    tokens=prompt_ids + generated)
                await keep(rec, body.previous_response_id, session)
            return final

        if body.stream:
            return ClosingStreamingResponse(
                _sse(stream, events, make_parser, finish), media_type="text/event-stream",
                headers=SSE_HEADERS)

        try:
            tally = await gen.collect(request, stream, 1)
        except RequestRejected as e:
            raise ApiError(400, str(e), param="input") from e
        if tally is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        parsed, reason = _parse(make_parser, tally.choices[0].text,
                                tally.choices[0].finish_reason)
        events.push(parsed)
        await finish(tally, reason)
        return JSONResponse(events.response)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        """A stored response; 404 when it is unknown, deleted or forgotten."""
        rec = await asyncio.to_thread(store.get, response_id)
        if rec is None:
            await forget_deleted(response_id)
            raise _not_found(response_id)
        return rec.body

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response and its session (its state then ages out)."""
        if not await asyncio.to_thread(store.delete, response_id):
            raise _not_found(response_id)
        await forget_session(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _parse(make_parser: Any, text: str, engine_reason: str | None
           ) -> tuple[list[Event], str | None]:
    """A whole reply as parser events (the streamed path's events, in one piece) and its
    settled finish reason."""
    if make_parser is None:
        return [ContentEvent(text)], engine_reason
    try:
        parser = make_parser()
        return parser.push(text) + parser.finish(), parser.finish_reason(engine_reason)
    except Exception:  # a parser bug must not cost the answer: return it as text
        log.exception("tool-call parser failed; returning the text as content")
        return [ContentEvent(text)], engine_reason


async def _sse(outputs: Any, events: ResponseEvents, make_parser: Any, finish: Any) -> Any:
    """The SSE body of a streamed response (module docstring of responses_events)."""
    parser = make_parser() if make_parser is not None else None
    tally = Tally(1)
    try:
        for ev in events.start():
            yield sse_bytes(ev)
        async for index, out in outputs:
            tally.add(index, out)
            if parser is None:
                parsed: list[Event] = [ContentEvent(out.text)] if out.text else []
            else:
                parsed = parser.push(out.text) if out.text else []
                if out.finished:
                    parsed += parser.finish()
            for ev in events.push(parsed):
                yield sse_bytes(ev)
            if out.finished:
                reason = (out.finish_reason if parser is None
                          else parser.finish_reason(out.finish_reason))
                for ev in await finish(tally, reason):
                    yield sse_bytes(ev)
    except ApiError as e:
        for ev in events.fail(e.message, e.code or "server_error"):
            yield sse_bytes(ev)
    except Exception:  # the stream has begun: report in-band, keep the server serving
        log.exception("streamed response failed")
        for ev in events.fail("internal server error"):
            yield sse_bytes(ev)
    finally:
        await outputs.aclose()

