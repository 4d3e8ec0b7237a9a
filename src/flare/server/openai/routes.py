"""OpenAI's Chat Completions and Completions surface: POST /v1/chat/completions,
POST /v1/completions and GET /v1/models, translated to and from the shared generation core
(`flare.server.generation`). Schemas in `messages`, `protocol` and `replies` beside it; the server-wide policies
(context length, max_tokens, n, errors, limits) are listed in `flare.server.app`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flare.runtime.request import GenerationRequest, RequestRejected
from flare.server.api_error import ApiError
from flare.server.generation import (
    FORCED_MODES,
    SSE_HEADERS,
    ClosingStreamingResponse,
    GenerationCore,
    new_id,
)
from flare.server.grammar import GrammarConstraint
from flare.server.guard import check_message_count, unencodable_text
from flare.server.logprobs import chat_logprobs, completion_logprobs
from flare.server.openai.messages import FunctionCall, ToolCallMessage
from flare.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from flare.server.openai.replies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from flare.server.streaming import (
    ChunkBuilder,
    api_finish_reason,
    flare_extension,
    sse_stream,
)
from flare.server.tool_calls import ParsedMessage, ToolCallParser


def openai_router(engine: Any, core: GenerationCore, settings: Any) -> APIRouter:
    """The OpenAI chat/completions routes over `engine` (an `AsyncEngine`), the shared
    core and the `ServerSettings`.

    Errors are raised as `ApiError` (OpenAI's error body, by the app's handler).
    """
    router = APIRouter()

    # ---- request preparation --------------------------------------------------------

    check_model = core.check_model
    served_name = core.served_name
    started = int(time.time())

    def check_logit_bias(req: ChatCompletionRequest | CompletionRequest) -> None:
        vocab = len(engine.tokenizer)
        bad = [t for t, _ in req.logit_bias_pairs if t >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias token id {bad[0]} is outside the vocabulary "
                                f"[0, {vocab}).", param="logit_bias")

    def check_n(n: int) -> None:
        if n > settings.max_n:
            raise ApiError(400, f"n is {n}; this server allows at most {settings.max_n}.",
                           param="n")

    def engine_requests(req: ChatCompletionRequest | CompletionRequest, response_id: str,
                        prompt_ids: list[int], max_tokens: int, arrival_ns: int,
                        constraints: list[GrammarConstraint] | None,
                        ) -> list[GenerationRequest]:
        return [
            GenerationRequest(
                request_id=f"{response_id}-{i}", prompt_token_ids=prompt_ids,
                params=req.sampling_params(max_tokens, choice_index=i),
                arrival_ns=arrival_ns,
                constraint=constraints[i] if constraints else None,
                session=req.session if i == 0 else None)  # choice 0 continues a session
            for i in range(req.n)
        ]

    async def constraints_for(req: ChatCompletionRequest) -> list[GrammarConstraint] | None:
        """One grammar constraint per choice, or None when nothing is forced.

        tool_choice required/named: the format's call markup around arguments valid for
        the tool's schema. response_format json_object/json_schema: that JSON; with
        tool_choice auto, that JSON or calls. A forced call wins over response_format.
        """
        mode = req.tool_mode
        rf = req.response_format
        answer = None
        if rf is not None and rf.type == "json_object":
            answer = {"type": "object"}
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            answer = rf.json_schema.schema_
        specs = [(t.function.name, t.function.parameters, t.function.strict is not False)
                 for t in req.tools or ()]
        return await core.constraints(specs, mode, only=req.forced_tool_name,
                                      parallel=req.parallel_tool_calls is not False,
                                      answer=answer, n=req.n)

    parse_choice = core.parse

    async def run(request: Request, req: ChatCompletionRequest | CompletionRequest,
                  kind: Literal["chat", "completion"], prompt_ids: list[int],
                  arrival_ns: int, constraints: list[GrammarConstraint] | None = None,
                  make_parser: Any = None) -> Response:
        """Generate and answer. `make_parser()` gives a fresh `ToolCallParser` per choice
        when the reply may hold tool calls."""
        param = "messages" if kind == "chat" else "prompt"
        max_tokens = core.completion_budget(req.requested_max_tokens, len(prompt_ids), param)
        core.check_session(req.session, len(prompt_ids) + max_tokens)
        check_logit_bias(req)
        response_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        created = int(time.time())
        outputs = core.generate(engine_requests(req, response_id, prompt_ids, max_tokens,
                                                arrival_ns, constraints), arrival_ns)

        if req.stream:
            builder = ChunkBuilder(kind, response_id, served_name, created, engine.package_id,
                                   req.include_usage, tokenizer=engine.tokenizer)
            parsers: list[ToolCallParser | None] | None = (
                [make_parser() for _ in range(req.n)] if make_parser else None)
            return ClosingStreamingResponse(
                sse_stream(outputs, builder, req.n, parsers), media_type="text/event-stream",
                headers=SSE_HEADERS)

        try:
            tally = await core.collect(request, outputs, req.n)
        except RequestRejected as e:  # checked above already; the engine has the last word
            raise ApiError(400, str(e), param=param) from e
        if tally is None:
            return Response(status_code=499)  # client closed the request; nobody reads this
        usage = tally.usage()
        if kind == "chat":
            choices = []
            for i, c in enumerate(tally.choices):
                parsed = (parse_choice(make_parser, c.text) if make_parser
                          else ParsedMessage(content=c.text))
                calls = [ToolCallMessage(id=t.id, function=FunctionCall(
                    name=t.name, arguments=t.arguments)) for t in parsed.tool_calls]
                message = AssistantMessage(
                    content=parsed.content if parsed.content or not calls else None,
                    tool_calls=calls or None)
                choices.append(ChatChoice(index=i, message=message, finish_reason=(
                    api_finish_reason(parsed.finish_reason(c.finish_reason), bool(calls))),
                    logprobs=chat_logprobs(c.logprobs, engine.tokenizer)))
            body: Any = ChatCompletionResponse(
                id=response_id, created=created, model=served_name,
                system_fingerprint=engine.package_id or None, usage=usage, choices=choices,
                flare=flare_extension(tally))
        else:
            body = CompletionResponse(
                id=response_id, created=created, model=served_name,
                system_fingerprint=engine.package_id or None, usage=usage,
                choices=[CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                          logprobs=completion_logprobs(c.logprobs,
                                                                       engine.tokenizer))
                         for i, c in enumerate(tally.choices)],
                flare=flare_extension(tally))
        return JSONResponse(body.model_dump())

    # ---- routes ---------------------------------------------------------------------

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completion; the prompt is rendered as `flare.server.chat` documents."""
        arrival_ns = time.monotonic_ns()
        check_model(body.model)
        check_n(body.n)
        check_message_count(len(body.messages), settings.max_messages)
        core.prompt_bound.check(sum(len(m.content or "") for m in body.messages), "messages")
        mode = body.tool_mode
        tools = body.tools if mode != "none" else None
        prompt_ids = await core.chat_prompt_ids(body.messages, tools)
        constraints = await constraints_for(body)
        make_parser = None
        if tools:
            make_parser = core.parser_factory([t.function.name for t in tools],
                                              1 if body.parallel_tool_calls is False else None,
                                              strict=mode in FORCED_MODES)
        return await run(request, body, "chat", prompt_ids, arrival_ns, constraints, make_parser)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completion. A string prompt is tokenized with the tokenizer's
        default special tokens (a BOS where the tokenizer adds one); a token-id list is
        used as given, each id checked against the vocabulary."""
        arrival_ns = time.monotonic_ns()
        check_model(body.model)
        check_n(body.n)
        tokenizer = engine.tokenizer
        if isinstance(body.prompt, str):
            core.prompt_bound.check(len(body.prompt), "prompt")
            try:
                prompt_ids = list(await asyncio.to_thread(tokenizer.encode, body.prompt))
            except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate escape
                raise unencodable_text("prompt") from e
        else:
            vocab = len(tokenizer)
            bad = next((t for t in body.prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary "
                                    f"[0, {vocab}).", param="prompt")
            prompt_ids = list(body.prompt)
        if not prompt_ids:
            raise ApiError(400, "prompt has no tokens.", param="prompt")
        return await run(request, body, "completion", prompt_ids, arrival_ns)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = ModelCard(id=served_name, created=started, max_model_len=engine.plan.max_seq_len)
        return ModelList(data=[card]).model_dump()

    return router
