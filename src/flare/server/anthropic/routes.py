"""The Anthropic Messages API routes over the shared generation core.

    POST /v1/messages               a message (non-streamed JSON, or SSE with stream: true)
    POST /v1/messages/count_tokens  {"input_tokens": N}: the rendered prompt's tokens

A request is converted (`flare.server.anthropic.protocol`) into the chat the OpenAI
surface renders, and runs through the same `GenerationCore`: the model name check, the
chat template with tools (Flare's fallback prompt for templates without tools), the
forcing grammar for `tool_choice` any / tool (the path of OpenAI's required / named), stop
sequences, sampling and the prefix cache. The reply is parsed by the served tool format
into text and tool_use blocks (`flare.server.anthropic.events`).

Every error on these paths, from validation to an unexpected exception, is answered in
Anthropic's shape (`flare.server.anthropic.errors`) by the route class `_MessagesRoute`;
the guard middleware does the same for 401, 413, 429 (here 529) and its 500. Unknown
paths under /v1/messages are a 404 `not_found_error`, a wrong method a 405. A forced
structure whose grammar fails mid-generation (the engine's "grammar_error") has no
stop_reason here: it is a 400 `invalid_request_error`, or an `error` event in a stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from flare.runtime.request import GenerationRequest, RequestOutput, RequestRejected
from flare.server.anthropic.chat_prompt import chat_messages
from flare.server.anthropic.errors import (
    api_error_message,
    api_error_response,
    error_body,
    error_response,
    messages_status,
)
from flare.server.anthropic.events import (
    StreamEvents,
    content_blocks,
    matched_stop,
    message,
    stop_reason,
    usage,
)
from flare.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    validation_message,
)
from flare.server.api_error import ApiError
from flare.server.generation import (
    FORCED_MODES,
    SSE_HEADERS,
    ClosingStreamingResponse,
    GenerationCore,
    new_id,
)
from flare.server.grammar import grammar_failure_message
from flare.server.guard import check_message_count
from flare.server.streaming import Tally

log = logging.getLogger(__name__)

_ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


class _MessagesRoute(APIRoute):
    """An APIRoute whose every failure is answered in Anthropic's error shape: request
    validation (400), `ApiError`s of the shared core, HTTP exceptions, an engine refusal
    (400) and anything unexpected (500, logged); a method the route does not take is 405."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                return error_response(400, validation_message(e.errors()))
            except ApiError as e:
                return api_error_response(e)
            except RequestRejected as e:
                return error_response(400, str(e))
            except StarletteHTTPException as e:
                return error_response(e.status_code, str(e.detail))
            except Exception:
                log.exception("unexpected error on %s", request.url.path)
                return error_response(500, "internal server error")

        return route

    async def handle(self, scope: Any, receive: Any, send: Any) -> None:
        if self.methods and scope["method"] not in self.methods:
            allowed = ", ".join(sorted(self.methods))
            response = error_response(
                405, f"{scope['method']} is not allowed on {self.path}; use {allowed}",
                headers={"Allow": allowed})
            await response(scope, receive, send)
            return
        await super().handle(scope, receive, send)


async def _recording(outputs: AsyncIterator[tuple[int, RequestOutput]], token_ids: list[int]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`outputs`, with every completion token id appended to `token_ids` (to tell which
    stop sequence ended the reply); closing this closes `outputs`."""
    try:
        async for item in outputs:
            token_ids.extend(item[1].token_ids)
            yield item
    finally:
        await outputs.aclose()


def messages_router(core: GenerationCore) -> APIRouter:
    """The /v1/messages routes over `core` (the app's shared generation core)."""
    router = APIRouter(route_class=_MessagesRoute)
    engine = core.engine
    tokenizer = engine.tokenizer
    eos_id = getattr(tokenizer, "eos_token_id", None)
    end_ids = set(getattr(engine, "eos_token_ids", ())) | ({eos_id} if eos_id is not None
                                                           else set())

    async def prompt_ids(body: CountTokensRequest) -> list[int]:
        """The rendered prompt's token ids (the prefill, if any, tokenized after it)."""
        check_message_count(len(body.messages), core.settings.max_messages)
        core.prompt_bound.check(body.text_length(), "messages")
        prompt = chat_messages(body)
        try:
            ids = await core.chat_prompt_ids(prompt.messages, prompt.tools)
        except ValidationError as e:  # a converted message the chat schema refuses
            raise ApiError(400, validation_message(e.errors()), param="messages") from e
        except ApiError as e:
            if e.code == "invalid_chat_template_input":
                e.param = None  # the index is the converted chat's, not the request's
            raise
        if prompt.prefill:
            ids = ids + list(await asyncio.to_thread(tokenizer.encode, prompt.prefill,
                                                     add_special_tokens=False))
        return ids

    def stop_of(body: MessagesRequest, finish_reason: str | None, has_calls: bool,
                token_ids: list[int]) -> tuple[str, str | None]:
        matched = None
        if (finish_reason == "stop" and body.stop_sequences and token_ids
                and token_ids[-1] not in end_ids):
            matched = matched_stop(tokenizer.decode(token_ids), body.stop_sequences)
        return stop_reason(finish_reason, has_calls, matched)

    async def stream(body: MessagesRequest, message_id: str,
                     outputs: AsyncIterator[tuple[int, RequestOutput]], make_parser: Any,
                     token_ids: list[int], constraint: Any) -> AsyncIterator[str]:
        events = StreamEvents(message_id, core.served_name)
        parser = make_parser() if make_parser else None
        tally = Tally(1)
        started = False
        try:
            async for _, out in outputs:
                tally.add(0, out)
                chunks: list[str] = []
                if not started:  # after prefill: the prompt's reuse is known
                    started = True
                    chunks += events.start(usage(out.num_prompt_tokens, out.num_cached_tokens,
                                                 0))
                if parser is None:
                    chunks += events.text(out.text)
                else:
                    ev = parser.push(out.text) if out.text else []
                    if out.finished:
                        ev += parser.finish()
                    chunks += events.events(ev)
                if out.finished and out.finish_reason == "grammar_error":
                    # Anthropic has no stop_reason for a failed structure: an error event
                    # ends the stream instead of message_delta / message_stop
                    chunks.append(events.error(error_body(400, grammar_failure_message(
                        constraint))))
                elif out.finished:
                    if parser is None:
                        reason, seq = stop_of(body, out.finish_reason, False, token_ids)
                    else:
                        reason, seq = stop_of(body, parser.finish_reason(out.finish_reason),
                                              parser.num_calls > 0, token_ids)
                    chunks += events.finish(reason, seq, usage(
                        out.num_prompt_tokens, out.num_cached_tokens,
                        out.num_completion_tokens))
                for chunk in chunks:
                    yield chunk
        except ApiError as e:
            yield events.error(error_body(messages_status(e), api_error_message(e)))
        except RequestRejected as e:
            yield events.error(error_body(400, str(e)))
        except Exception:  # the stream has begun: report in-band, keep serving
            log.exception("streamed message failed")
            yield events.error(error_body(500, "internal server error"))
        finally:
            await outputs.aclose()

    @router.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API (module docstring)."""
        arrival_ns = time.monotonic_ns()
        core.check_model(body.model)
        ids = await prompt_ids(body)
        max_tokens = core.completion_budget(body.max_tokens, len(ids), "messages")
        mode = body.tool_mode
        tools = (body.tools or []) if mode != "none" else []
        only = body.tool_choice.name if body.tool_choice and mode == "named" else None
        constraints = await core.constraints([(t.name, t.input_schema, t.strict is not False)
                                              for t in tools], mode,
                                             only=only, parallel=body.parallel)
        make_parser = (core.parser_factory([t.name for t in tools], None if body.parallel else 1,
                                           strict=mode in FORCED_MODES) if tools else None)
        message_id = new_id("msg", "_")
        request_ = GenerationRequest(request_id=message_id, prompt_token_ids=ids,
                                     params=body.sampling_params(max_tokens),
                                     arrival_ns=arrival_ns,
                                     constraint=constraints[0] if constraints else None)
        token_ids: list[int] = []
        outputs = _recording(core.generate([request_], arrival_ns), token_ids)
        if body.stream:
            return ClosingStreamingResponse(
                stream(body, message_id, outputs, make_parser, token_ids,
                       request_.constraint),
                media_type="text/event-stream", headers=SSE_HEADERS)
        tally = await core.collect(request, outputs, 1)
        if tally is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        c = tally.choices[0]
        if c.finish_reason == "grammar_error":  # no stop_reason says it: an error answer
            raise ApiError(400, grammar_failure_message(request_.constraint),
                           code="grammar_error")
        parsed = core.parse(make_parser, c.text)
        reason, seq = stop_of(body, parsed.finish_reason(c.finish_reason),
                              bool(parsed.tool_calls), token_ids)
        return JSONResponse(message(
            message_id, core.served_name, content_blocks(parsed.content, parsed.tool_calls),
            reason, seq, usage(c.num_prompt_tokens, c.num_cached_tokens,
                               c.num_completion_tokens)))

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """The prompt's token count, as /v1/messages would render it."""
        core.check_model(body.model)
        return {"input_tokens": len(await prompt_ids(body))}

    @router.api_route("/v1/messages/{rest:path}", methods=_ALL_METHODS,
                      include_in_schema=False)
    async def unknown(rest: str) -> Response:
        """Any other path under /v1/messages: Anthropic's 404."""
        raise ApiError(404, f"there is no route /v1/messages/{rest} on this server",
                       code="not_found")

    return router
