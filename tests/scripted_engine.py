"""An AsyncEngine stand-in for the server tests that need no model: the real app
(`create_app`) serves outputs a test scripts, so a test can pin down exactly what the core
streams (split markup, a finish reason, an error, an exception) and what it was asked."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from flare.package.plan import CapacityPlan
from flare.runtime.request import RequestOutput, RequestTimings

Script = Callable[[Any], Iterable[RequestOutput]]  # core request -> its outputs


def answer(text: str, reason: str = "stop") -> Script:
    """A script that answers every request with `text` in 5-character outputs (so markup is
    split across stream chunks, as the engine streams it), the last one finished with
    `reason`; each output counts one more completion token (token id 7)."""

    def script(request) -> Iterable[RequestOutput]:
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)] or [""]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield RequestOutput(
                request.request_id, token_ids=[7], text=piece, finished=last,
                finish_reason=reason if last else None,
                num_prompt_tokens=len(request.prompt_token_ids), num_completion_tokens=k + 1,
                timings=replace(RequestTimings(request.arrival_ns), finished_ns=1)
                if last else None)

    return script


class ScriptedEngine:
    """AsyncEngine stand-in whose outputs (or exception) come from `script(request)`, each
    given the request's id; it keeps the requests it got (`requests`) and the ids of those
    whose stream closed, finished or not (`closed`).

    Args:
        tokenizer: the Hugging Face tokenizer the app renders prompts with.
        script: see `Script`; replace `engine.script` to change the answer between requests.
        max_seq_len, num_pages: the capacity plan the app reports (page size 16).
        stats: what `stats()` returns (the `/debug/state` and `/metrics` figures).
    """

    model_name = "fake"
    package_id = "pkg-fake"

    def __init__(self, tokenizer, script: Script, *, max_seq_len: int = 1024,
                 num_pages: int = 128, stats: dict[str, int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.plan = CapacityPlan(max_seq_len=max_seq_len, max_num_seqs=2, page_size=16,
                                 num_pages=num_pages, max_batch_tokens=64)
        self.script = script
        self._stats = dict(stats or {})
        self.requests: list = []
        self.closed: list[str] = []

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def generate(self, request):
        self.requests.append(request)
        try:
            for out in self.script(request):
                await asyncio.sleep(0)
                yield replace(out, request_id=request.request_id)
        finally:
            self.closed.append(request.request_id)

    async def shutdown(self) -> None:
        pass
