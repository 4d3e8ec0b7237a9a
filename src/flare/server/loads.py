"""GET /v1/loads: the engine's load in the shape SGLang's model gateway (`smg`) polls.

smg's load-aware routing policies (power-of-two, cache-aware's balance threshold) read a
worker's load from `GET /v1/loads?include=core,...` when the worker is neither vLLM nor
SGLang (docs/scale-out.md). The body is smg's `WorkerLoadResponse`: one data-parallel rank
whose snapshot carries running and waiting requests, KV tokens used and held, their ratio
(`token_usage`, what the policies act on) and the share of prompt tokens served from the
prefix cache. Fields smg knows that Flare has no figure for are left out (smg defaults
them). The `include` parameter is accepted and ignored: every section Flare has is sent.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter


def load_snapshot(stats: dict[str, int], page_size: int, max_running: int) -> dict[str, Any]:
    """One rank's `SchedulerLoadSnapshot` from `Engine.stats()`.

    Args:
        stats: the engine's counters (`flare.runtime.engine_stats.EngineStats.stats`).
        page_size: tokens per KV page.
        max_running: the plan's most sequences running at once (`max_num_seqs`).
    """
    total = stats["pages_total"] * page_size
    used = stats["pages_used"] * page_size
    queried = stats.get("prefix_cache_queries_total", 0)
    return {
        "dp_rank": 0,
        "num_running_reqs": stats["num_running"],
        "num_waiting_reqs": stats["num_waiting"],
        "num_total_reqs": stats["num_running"] + stats["num_waiting"],
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": used / total if total else 0.0,
        "cache_hit_rate": stats.get("prefix_cache_hits_total", 0) / queried if queried else 0.0,
        "max_running_requests": max_running,
    }


def loads_router(engine: Any) -> APIRouter:
    """The /v1/loads route over `engine` (a `flare.runtime.async_engine.AsyncEngine`)."""
    router = APIRouter()

    @router.get("/v1/loads")
    async def loads(include: str | None = None) -> dict[str, Any]:
        """The engine's load for a gateway (module docstring)."""
        plan = engine.plan
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
                "loads": [load_snapshot(dict(engine.stats()), plan.page_size,
                                        plan.max_num_seqs)]}

    return router
