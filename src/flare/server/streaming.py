"""Server-sent events for streamed completions, and the merge of n choices' engine streams.

Wire format (OpenAI's): each event is `data: {json}\\n\\n`; the stream ends with
`data: [DONE]\\n\\n`. For chat, each choice opens with a chunk whose delta carries the role,
then content chunks, then a chunk with an empty delta and its `finish_reason`. With
`stream_options.include_usage` every chunk carries `"usage": null` and one last chunk with
`"choices": []` carries the usage, right before `[DONE]`. An engine-side failure becomes an
`{"error": {...}}` event followed by `[DONE]` (the HTTP status is already 200 by then).

Tool calls (chat with tools): each choice's text goes through its `ToolCallParser`; content
events become `delta.content`, each complete call two deltas in `delta.tool_calls`: first
`{index, id, type, function: {name, arguments: ""}}`, then `{index, function: {arguments}}`.
A choice that emitted calls and stopped finishes with `tool_calls`.

Logprobs (when asked): the `TokenLogprob`s of a choice wait until that choice's next chunk
(text, tool call or finish) and ride on it as `choices[].logprobs`, so a token's logprob
travels with its text even when stop-string matching held the text back; concatenating a
choice's chunk logprobs gives the non-streamed `logprobs`. Text completions continue
`text_offset` across chunks.

The last chunk before `[DONE]` (the usage chunk when asked for, else the finish chunk of the
last choice to finish) carries the `flare` extension object (docs/api-extensions.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from flare.runtime.request import RequestOutput, TokenLogprob
from flare.server.api_error import ApiError, error_body
from flare.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from flare.server.openai.replies import Usage
from flare.server.tool_calls import ContentEvent, Event, ToolCallParser

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"

T = TypeVar("T")


def sse_event(payload: dict[str, Any]) -> str:
    """One SSE event: `data: <compact JSON, UTF-8 not escaped>\\n\\n`."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _aclose(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async streams as `(stream index, item)`, in arrival order.

    Every stream is closed (`aclose`) when the merge ends for any reason: exhaustion, an
    error in one stream (re-raised here after the others are closed), or the consumer
    stopping or being cancelled. Closing an engine stream aborts its request in the engine,
    which frees its pages; that is how a client disconnect reaches the engine.
    """
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _aclose(streams[0])
        return

    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    end = object()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, end, None))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, end, e))
        finally:
            await _aclose(stream)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is end:
                live -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceResult:
    """What one choice produced so far."""

    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    final: RequestOutput | None = None  # the finished output (timings, reuse)
    logprobs: list[TokenLogprob] | None = None  # None: not asked for

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Tally:
    """Accumulates the engine outputs of a request's n choices.

    Args:
        n: number of choices.
    """

    def __init__(self, n: int) -> None:
        self.choices = [ChoiceResult() for _ in range(n)]

    def add(self, index: int, out: RequestOutput) -> None:
        """Record one engine output of choice `index`.

        Raises:
            ApiError: 500 when the engine failed the request (`out.error`) or aborted it.
        """
        c = self.choices[index]
        if out.text:
            c.text_parts.append(out.text)
        if out.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(out.logprobs)
        c.num_prompt_tokens = out.num_prompt_tokens
        c.num_completion_tokens = out.num_completion_tokens
        c.num_cached_tokens = out.num_cached_tokens
        if out.error is not None or (out.finished and out.finish_reason == "abort"):
            reason = out.error or "the request was aborted by the server"
            raise ApiError(500, f"generation failed: {reason}", type="server_error",
                           code="engine_error")
        if out.finished:
            c.finish_reason = out.finish_reason
            c.final = out

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> Usage:
        """Usage over all choices: the prompt counted once, completions summed.

        `cached_tokens` is the least any choice reused, so it never overstates the saving.
        """
        return Usage.of(
            prompt_tokens=self.choices[0].num_prompt_tokens,
            completion_tokens=sum(c.num_completion_tokens for c in self.choices),
            cached_tokens=min(c.num_cached_tokens for c in self.choices),
        )


def api_finish_reason(engine_reason: str | None, has_tool_calls: bool) -> str:
    """OpenAI's finish_reason: a stopped choice that emitted tool calls ends with
    "tool_calls"; "length" stays "length" (the output was cut)."""
    reason = engine_reason or "stop"
    return "tool_calls" if has_tool_calls and reason == "stop" else reason


def flare_extension(tally: Tally) -> dict[str, Any]:
    """The `flare` extension object of a finished response (docs/api-extensions.md):
    per choice its engine request id, server-clock timings (ns) and prefix-reuse outcome."""
    choices = []
    for i, c in enumerate(tally.choices):
        out = c.final
        t = out.timings if out is not None else None
        choices.append({
            "index": i,
            "request_id": out.request_id if out is not None else None,
            "clock": "server_monotonic_ns",
            "timings": {
                "arrival_ns": t.arrival_ns if t else None,
                "scheduled_ns": t.scheduled_ns if t else None,
                "first_token_ns": t.first_token_ns if t else None,
                "finished_ns": t.finished_ns if t else None,
            },
            "reuse": out.reuse if out is not None else None,
        })
    return {"choices": choices}


class ChunkBuilder:
    """Builds the JSON chunks of one streamed response.

    Args:
        kind: "chat" (object chat.completion.chunk, `delta`) or "completion"
            (object text_completion, `text`).
        response_id: the response id shared by all chunks ("chatcmpl-...", "cmpl-...").
        model: the model name to report.
        created: Unix time (s) the request was received.
        system_fingerprint: the package id, so clients can tell served packages apart.
        include_usage: add `"usage": null` to every chunk (a usage chunk ends the stream).
        tokenizer: the served tokenizer, to write logprobs' token texts (needed only when
            the engine outputs carry logprobs).
    """

    def __init__(
        self,
        kind: Literal["chat", "completion"],
        response_id: str,
        model: str,
        created: int,
        system_fingerprint: str | None,
        include_usage: bool,
        tokenizer: Any = None,
    ) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self._tokenizer = tokenizer
        self._offsets: dict[int, TextOffsets] = {}  # completion: per choice
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": system_fingerprint,
        }

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {**self._head, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _choice(self, index: int, text: str | None, finish_reason: str | None) -> dict[str, Any]:
        if self.kind == "chat":
            delta = {} if text is None else {"content": text}
            return {"index": index, "delta": delta, "logprobs": None,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": None,
                "finish_reason": finish_reason}

    def opening(self, index: int) -> dict[str, Any] | None:
        """Chat: the first chunk of a choice, carrying the assistant role. Completion: None."""
        if self.kind != "chat":
            return None
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])

    def text(self, index: int, text: str) -> dict[str, Any]:
        """A chunk with new text for choice `index`."""
        return self._chunk([self._choice(index, text, None)])

    def tool_call(self, index: int, call_index: int, *, id: str | None = None,
                  name: str | None = None, arguments: str = "") -> dict[str, Any]:
        """A chunk with one tool-call delta: the opening one carries `id` and `name`."""
        entry: dict[str, Any] = {"index": call_index}
        if id is not None:
            entry.update(id=id, type="function")
        function: dict[str, Any] = {"arguments": arguments}
        if name is not None:
            function = {"name": name, **function}
        entry["function"] = function
        return self._chunk([{"index": index, "delta": {"tool_calls": [entry]},
                             "logprobs": None, "finish_reason": None}])

    def events(self, index: int, events: Sequence[Event]) -> list[dict[str, Any]]:
        """Chunks for parser events of choice `index` (adjacent content merged)."""
        chunks: list[dict[str, Any]] = []
        text = ""
        for ev in events:
            if isinstance(ev, ContentEvent):
                text += ev.text
                continue
            if text:
                chunks.append(self.text(index, text))
                text = ""
            call = ev.call
            chunks.append(self.tool_call(index, ev.index, id=call.id, name=call.name))
            chunks.append(self.tool_call(index, ev.index, arguments=call.arguments))
        if text:
            chunks.append(self.text(index, text))
        return chunks

    def add_logprobs(self, chunk: dict[str, Any], entries: Sequence[TokenLogprob]) -> None:
        """Put `entries` (tokens of the chunk's one choice) on `chunk` as its `logprobs`."""
        choice = chunk["choices"][0]
        if self.kind == "chat":
            lp = chat_logprobs(entries, self._tokenizer)
        else:
            offsets = self._offsets.setdefault(choice["index"], TextOffsets())
            lp = completion_logprobs(entries, self._tokenizer, offsets)
        choice["logprobs"] = lp.model_dump() if lp is not None else None

    def finish(self, index: int, finish_reason: str,
               flare: dict[str, Any] | None = None) -> dict[str, Any]:
        """The last chunk of choice `index`: no new text, its finish reason."""
        chunk = self._chunk([self._choice(index, None, finish_reason)])
        if flare is not None:
            chunk["flare"] = flare
        return chunk

    def usage(self, usage: Usage, flare: dict[str, Any] | None = None) -> dict[str, Any]:
        """The usage chunk: `choices: []` and the totals."""
        chunk = {**self._head, "choices": [], "usage": usage.model_dump()}
        if flare is not None:
            chunk["flare"] = flare
        return chunk


async def sse_stream(
    outputs: AsyncIterator[tuple[int, RequestOutput]], builder: ChunkBuilder, n: int,
    parsers: Sequence[ToolCallParser | None] | None = None,
) -> AsyncIterator[str]:
    """SSE events for the merged engine outputs of n choices, ending with `[DONE]`.

    Args:
        parsers: per choice, the tool-call parser its text goes through (None: plain text).

    An engine failure or an unexpected exception becomes an error event, then `[DONE]`.
    Cancellation (client gone) is not caught: it closes `outputs`, which aborts the
    requests in the engine.
    """
    tally = Tally(n)
    parsers = parsers or [None] * n
    pending: list[list[TokenLogprob]] = [[] for _ in range(n)]  # logprobs awaiting a chunk
    try:
        for i in range(n):
            opening = builder.opening(i)
            if opening is not None:
                yield sse_event(opening)
        async for index, out in outputs:
            tally.add(index, out)
            pending[index].extend(out.logprobs or ())
            parser = parsers[index]
            chunks: list[dict[str, Any]] = []
            if parser is None:
                if out.text:
                    chunks.append(builder.text(index, out.text))
            else:
                events = parser.push(out.text) if out.text else []
                if out.finished:
                    events += parser.finish()
                chunks += builder.events(index, events)
            if out.finished:
                if parser is None:
                    reason = api_finish_reason(out.finish_reason, False)
                else:
                    reason = api_finish_reason(parser.finish_reason(out.finish_reason),
                                               parser.num_calls > 0)
                last = tally.done and not builder.include_usage
                chunks.append(builder.finish(index, reason,
                                             flare_extension(tally) if last else None))
            if chunks and pending[index]:
                builder.add_logprobs(chunks[0], pending[index])
                pending[index] = []
            for chunk in chunks:
                yield sse_event(chunk)
        if builder.include_usage:
            yield sse_event(builder.usage(tally.usage(), flare_extension(tally)))
    except ApiError as e:
        yield sse_event(e.body())
    except Exception:  # the stream has begun: report in-band, keep the server serving
        log.exception("streamed request failed")
        yield sse_event(error_body("internal server error", type="server_error"))
    finally:
        await _aclose(outputs)
    yield SSE_DONE
