"""The generation core shared by the API surfaces: OpenAI chat and text completions
(`flare.server.openai.routes`), the Responses API (`flare.server.responses`) and any other
surface mounted on the same engine.

`GenerationCore` holds what every surface needs from the served engine and settings, so a
surface is a protocol translation and nothing more:

- `check_model`: the model name a request gives must be the served one (404 otherwise);
- `completion_budget`: the context-length policy (a prompt of `max_seq_len` tokens or more
  is a 400 `context_length_exceeded`; max tokens clamped to the room left);
- `check_session`: a named session must be able to pin its state (400 when it cannot);
- `chat_prompt_ids`: chat messages -> prompt token ids off the event loop, template errors
  as 400s naming the message;
- `constraints`: the llguidance grammar of a forced tool call or a JSON answer, compiled off
  the event loop, one constraint per choice;
- `parser_factory`, `parse`: the served tool-call format's parser for a reply;
- `generate`: engine streams of one request's choices, merged, under the request timeout;
- `collect`: a whole non-streamed reply, or None when the client disconnects first.

`ClosingStreamingResponse` is the streaming response every surface answers with: it always
closes its body, which aborts the engine requests of a client that went away.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from flare.runtime.request import RequestRejected
from flare.runtime.request import GenerationRequest, RequestOutput
from flare.server.api_error import ApiError
from flare.server.chat import ChatTemplateError, chat_prompt_ids
from flare.server.grammar import (
    GrammarCompiler,
    GrammarConstraint,
    GrammarError,
    ToolSpec,
    json_grammar,
    tool_call_grammar,
)
from flare.server.guard import PromptBound, ServerCounters, unencodable_text, with_deadline
from flare.server.openai.messages import ChatMessage, Tool
from flare.server.queue_bound import reserve_choices
from flare.server.schema_check import check_request_schemas
from flare.server.streaming import Tally, merge_streams
from flare.server.tool_calls import ParsedMessage, ToolCallParser
from flare.server.tool_formats import ToolFormat, get_format

log = logging.getLogger(__name__)

T = TypeVar("T")

# tool choices whose answer is forced to be calls (the forcing grammar, a strict parser)
FORCED_MODES = ("required", "named")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Starlette cancels the sending task when the client disconnects; if the iterator was
    suspended at a `yield` it would only be closed when garbage-collected. Closing it here
    aborts the engine requests at once, so their pages are freed at the engine's next step.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has disconnected (call after the body has been read)."""
    # After the body has been read, the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` until it completes or the client disconnects (then `work` is cancelled).

    Returns:
        (True, result) when `work` completed, (False, None) when the client left first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:
        task.cancel()
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


def new_id(prefix: str, sep: str = "-") -> str:
    """A fresh response id: `prefix`, `sep`, 32 hex digits."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


class GenerationCore:
    """What every API surface needs from the served engine (module docstring).

    Args:
        engine: the `AsyncEngine` (or a test double with the same surface).
        settings: the `ServerSettings`.
        counters: the server's counters (timeouts are counted there).
    """

    def __init__(self, engine: Any, settings: Any, counters: ServerCounters) -> None:
        self.engine = engine
        self.settings = settings
        self.counters = counters
        template = getattr(engine.tokenizer, "chat_template", None)
        self.tool_format: ToolFormat = get_format(
            settings.tool_parser, template if isinstance(template, str) else None)
        self.grammars = GrammarCompiler(engine.tokenizer, getattr(engine, "eos_token_ids", ()))
        self.served_name: str = settings.served_model_name or engine.model_name
        self.accepted_names = {n for n in (self.served_name, engine.model_name,
                                           engine.package_id) if n}
        self.prompt_bound = PromptBound(engine.tokenizer, engine.plan.max_seq_len)
        self.metrics: Any = None  # flare.server.metrics.RequestMetrics: observes each stream

    # ---- checks -------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        """404 `model_not_found` unless `name` is the served model (or its package id)."""
        if name not in self.accepted_names:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves "
                                f"'{self.served_name}'.", param="model", code="model_not_found")

    def completion_budget(self, requested: int | None, num_prompt: int, param: str) -> int:
        """Max new tokens after the context-length policy: a prompt of `max_seq_len` tokens
        or more is a 400 naming `param`; `requested` (None: all the room) is clamped to the
        room left."""
        limit = self.engine.plan.max_seq_len
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"prompt has {num_prompt} tokens, which leaves no room for a completion "
                f"(the prompt must have fewer than {limit} tokens).",
                param=param, code="context_length_exceeded")
        remaining = limit - num_prompt
        return remaining if requested is None else min(requested, remaining)

    def check_session(self, session: str | None, num_tokens: int,
                      param: str | None = None) -> None:
        """A named session must be able to pin its state of up to `num_tokens` tokens
        (docs/api-extensions.md); 400 otherwise, naming `param` (default: the engine's)."""
        core = getattr(self.engine, "engine", None)
        if session is None or not hasattr(core, "check_session_budget"):
            return
        try:
            core.check_session_budget(session, num_tokens)
        except RequestRejected as e:
            raise ApiError(400, str(e), param=param or e.param, code=e.code) from None

    def check_logit_bias(self, pairs: Sequence[tuple[int, float]]) -> None:
        """400 when a logit_bias token id is outside the vocabulary."""
        vocab = len(self.engine.tokenizer)
        bad = [t for t, _ in pairs if t >= vocab]
        if bad:
            raise ApiError(400, f"logit_bias token id {bad[0]} is outside the vocabulary "
                                f"[0, {vocab}).", param="logit_bias")

    def check_n(self, n: int) -> None:
        """400 when `n` exceeds the server's `max_n`."""
        if n > self.settings.max_n:
            raise ApiError(400, f"n is {n}; this server allows at most {self.settings.max_n}.",
                           param="n")

    # ---- prompts and constraints --------------------------------------------------------

    async def chat_prompt_ids(self, messages: Sequence[ChatMessage | dict[str, Any]],
                              tools: Sequence[Tool | dict[str, Any]] | None) -> list[int]:
        """Prompt token ids of a chat conversation, rendered off the event loop (a
        multi-MB prompt takes seconds to render and tokenize).

        Raises:
            ApiError: 400 naming `messages[i]` when the template rejects the conversation,
                or `messages` when its text cannot be encoded.
        """
        try:
            return await asyncio.to_thread(chat_prompt_ids, self.engine.tokenizer, messages,
                                           tools, self.tool_format)
        except ChatTemplateError as e:
            param = f"messages[{e.message_index}]" if e.message_index is not None else "messages"
            raise ApiError(400, str(e), param=param, code="invalid_chat_template_input") from e
        except (TypeError, UnicodeError) as e:  # e.g. a lone surrogate escape ("\ud800")
            raise unencodable_text("messages") from e

    async def constraints(self, specs: Sequence[ToolSpec], mode: str,
                          *, only: str | None = None, parallel: bool = True,
                          answer: dict[str, Any] | None = None, n: int = 1,
                          ) -> list[GrammarConstraint] | None:
        """One grammar constraint per choice, or None when nothing is forced.

        Args:
            specs: (name, parameters schema[, strict]) per tool, in request order; the
                arguments are strict (`flare.server.grammar.strict_schema`) unless a
                tool's strict is False.
            mode: "none", "auto", "required" or "named" (the tool choice).
            only: the tool a "named" choice forces.
            parallel: allow several forced calls.
            answer: the JSON schema the answer must match (json_object: `{"type":
                "object"}`), or None.
            n: choices.

        tool_choice required/named: the format's call markup around arguments valid for the
        tool's schema. An answer schema: that JSON; with tool_choice auto, that JSON or
        calls. A forced call wins over the answer schema.

        Raises:
            ApiError: 400 `unsupported_schema` naming the chat field llguidance cannot
                enforce (`response_format`, `tools[i].function.parameters`), or whose
                schema no finite value satisfies (`flare.server.schema_check`; checked for
                every tool whatever the tool choice, before anything is compiled).
        """
        check_request_schemas(specs, answer)
        fmt = self.tool_format
        if mode in FORCED_MODES:
            grammar, parts = tool_call_grammar(fmt, specs, only=only, parallel=parallel)
        elif answer is not None and mode == "auto":
            grammar, parts = tool_call_grammar(fmt, specs, parallel=parallel,
                                               answer_schema=answer)
        elif answer is not None:
            grammar, parts = json_grammar(answer)
        else:
            return None
        try:
            first = await asyncio.to_thread(self.grammars.compile, grammar, parts)
        except GrammarError as e:
            raise ApiError(400, str(e), param=e.param, code="unsupported_schema") from e
        return self.grammars.copies(first, n)

    def parser_factory(self, names: Sequence[str], max_calls: int | None = None,
                       strict: bool = False) -> Callable[[], ToolCallParser]:
        """A factory of fresh parsers of the served tool-call format for these tools
        (`max_calls`: keep at most that many calls, None: all; `strict`: the answer is
        forced, `mode in FORCED_MODES`, so an unfinished call at the end is dropped and
        `ToolCallParser.finish_reason` settles the finish reason)."""
        names = list(names)
        return lambda: self.tool_format.parser(names, max_calls, strict)

    @staticmethod
    def parse(make_parser: Callable[[], ToolCallParser] | None, text: str) -> ParsedMessage:
        """A whole reply parsed into content and calls; a parser bug costs nothing but the
        parse (the text is returned as content)."""
        if make_parser is None:
            return ParsedMessage(content=text)
        try:
            return make_parser().parse(text)
        except Exception:  # a parser bug must not cost the answer: return it as text
            log.exception("tool-call parser failed; returning the text as content")
            return ParsedMessage(content=text)

    # ---- generation ---------------------------------------------------------------------

    def generate(self, requests: Sequence[GenerationRequest], arrival_ns: int
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The merged engine streams `(choice index, output)` of one API request, under
        the server's request timeout (measured from `arrival_ns`, monotonic).

        Raises:
            ApiError: 429 `queue_full` when `n` choices would pass the queue bound
                (`flare.server.queue_bound.reserve_choices`).
        """
        reserve_choices(len(requests))
        streams = [self.engine.generate(r) for r in requests]
        if self.metrics is not None:
            streams = [self.metrics.observe(s) for s in streams]
        outputs = merge_streams(streams)
        timeout = self.settings.request_timeout_s
        if timeout is not None:
            deadline = arrival_ns / 1e9 + timeout  # monotonic clock, s
            outputs = with_deadline(outputs, deadline, timeout, self.counters)
        return outputs

    async def collect(self, request: Request, outputs: AsyncIterator[tuple[int, RequestOutput]],
                      n: int) -> Tally | None:
        """Every output of a non-streamed request, or None when the client disconnected
        first (its engine requests are then aborted).

        Raises:
            RequestRejected: the engine refused the request (callers answer 400).
            ApiError: 500 when the engine failed it (`Tally.add`); 504 on the timeout.
        """
        async def run() -> Tally:
            tally = Tally(n)
            try:
                async for index, out in outputs:
                    tally.add(index, out)
            finally:
                await outputs.aclose()
            return tally

        completed, tally = await unless_disconnected(request, run())
        return tally if completed else None
