"""Named sessions pin their latest state on the device: eviction pressure from other
traffic cannot take it, the pin budget is enforced with a clear refusal, forks share the
pinned pages, and releasing every pin brings the pool back to its baseline."""

from __future__ import annotations

import pytest
from test_tiers import cold, greedy, make_engine, run, tiny, words  # noqa: F401

from flare.runtime.engine import Engine
from flare.runtime.request import RequestRejected
from flare.runtime.request import GenerationRequest


def turn(engine: Engine, ids: list[int], rid: str, session: str | None = None,
         n: int = 8) -> tuple[list[int], object]:
    req = GenerationRequest(rid, ids, greedy(n), session=session)
    outs = engine.run_until_idle([req])[rid]
    return sum((o.token_ids for o in outs), []), outs[-1]


def pressure(engine: Engine, rounds: int = 6) -> None:
    """Other conversations, enough to evict every unpinned cached page of a small pool."""
    for i in range(rounds):
        run(engine, words(120, seed=500 + i), f"other-{i}")


@pytest.mark.parametrize("named", [True, False])
def test_a_named_session_keeps_its_state_under_eviction_pressure(tiny, cold, named):
    engine = make_engine(tiny, host_tier_bytes=0, num_pages=32)
    first = words(41, seed=61)
    answer, _ = turn(engine, first, "t1", session="agent" if named else None)
    pressure(engine)
    nxt = first + answer + words(9, seed=62)
    got, last = turn(engine, nxt, "t2", session="agent" if named else None)
    assert got == run(cold, nxt)[0]
    if named:
        assert last.num_cached_tokens == 48  # all of turn 1 stayed on the device
        assert engine.stats()["session_pinned_pages"] == 5  # now turn 2's 65 tokens
    else:
        assert last.num_cached_tokens < 48
    engine.check_integrity()


def test_pin_budget_refuses_clearly_and_release_returns_every_page(tiny):
    engine = make_engine(tiny, host_tier_bytes=0, max_pinned_pages=3)
    ids = words(41, seed=71)
    turn(engine, ids, "a", session="a")  # 48 computed tokens: 3 pages pinned
    assert engine.pins.pinned_pages == 3
    engine.check_session_budget("a", 48)  # replacing its own pin fits
    with pytest.raises(RequestRejected, match="would pin up to 1 KV pages") as err:
        engine.check_session_budget("b", 10)
    assert err.value.param == "session" and err.value.code == "session_budget_exceeded"
    assert engine.pins.fork("a", "a2") is False  # a fork would double the pinned pages
    engine.pins.release("a")
    assert engine.pins.fork("a", "a3") is False  # nothing pinned to fork any more
    engine.check_integrity()
    engine.prefix_index.clear()
    assert engine.pool.num_used == 0


def test_forked_sessions_share_pinned_pages_and_branches_stay_apart(tiny, cold):
    engine = make_engine(tiny, host_tier_bytes=0)
    base = words(41, seed=81)
    answer, _ = turn(engine, base, "main", session="main")
    assert engine.pins.fork("main", "branch")
    shared = set(engine.pins._pins["main"][0]) & set(engine.pins._pins["branch"][0])
    assert len(shared) == 3
    left = base + answer + words(7, seed=82)
    right = base + answer + words(7, seed=83)
    got_left, _ = turn(engine, left, "l", session="main")
    got_right, last = turn(engine, right, "r", session="branch")
    assert got_left == run(cold, left)[0] and got_right == run(cold, right)[0]
    assert last.num_cached_tokens >= 48  # the shared history (and what "main" computed)
    engine.check_integrity()
    for name in ("main", "branch"):
        engine.pins.release(name)
    engine.prefix_index.clear()
    assert engine.pool.num_used == 0
