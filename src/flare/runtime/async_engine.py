"""Bridge between the engine's thread and asyncio: one queue per request.

`generate` yields a request's outputs as the engine produces them. If the consumer stops
early (client disconnect, task cancelled), the request is aborted in the engine, which
releases its pages at its next step.

`on_enqueued` is how a caller learns the moment its request is counted in the engine's
`num_waiting`: the HTTP server's queue bound (`flare.server.queue_bound.Admission`) sets it for
the duration of a request and releases its admission ticket there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, RequestOutput

# Called with no arguments, in the submitting context, right after `generate` has queued a
# request in the engine (so `num_waiting` already counts it); None: nobody is told.
on_enqueued: ContextVar[Callable[[], None] | None] = ContextVar("flare_on_enqueued",
                                                                 default=None)


class AsyncEngine:
    """Runs an `Engine` in its thread and serves requests to coroutines.

    Must be created inside the running event loop that will call `generate`.
    """

    def __init__(self, engine: Engine, model_name: str = "model", package_id: str = "") -> None:
        self.engine = engine
        self.model_name = model_name
        self.package_id = package_id
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop = asyncio.get_running_loop()
        engine.on_output = self._on_output
        engine.start()

    @property
    def tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        return self.engine.tokenizer

    @property
    def plan(self):  # noqa: ANN201 - CapacityPlan
        return self.engine.plan

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    @property
    def num_waiting(self) -> int:
        """Requests the engine has not started yet (cheap: the request guard reads it)."""
        return self.engine.num_waiting

    def _on_output(self, out: RequestOutput) -> None:
        # called on the engine thread
        queue = self._queues.get(out.request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, out)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield its outputs until the finished one.

        Raises:
            flare.runtime.request.RequestRejected: the request does not fit the plan.
            ValueError: a request with this id is already live.
        """
        rid = request.request_id
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already live")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            self.engine.add_request(request)
            hook = on_enqueued.get()
            if hook is not None:
                hook()
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            del self._queues[rid]
            if not finished:
                self.engine.abort(rid)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.stop)
