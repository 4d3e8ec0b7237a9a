"""SSE chunks for tool calls and the `flare` extension (case api-tool-stream-indices).

Engine outputs are scripted (recorded text split into arbitrary pieces); the chunks must
be OpenAI's tool-call deltas and reassemble into the non-streamed message.
"""

from __future__ import annotations

import asyncio
import json

from flare.runtime.request import RequestOutput, RequestTimings
from flare.server.streaming import ChunkBuilder, sse_stream
from flare.server.tool_parsers import HermesParser

TOOLS = ["run_shell", "list_files"]
TWO_CALLS = ('Sure.\n<tool_call>\n{"name": "run_shell", "arguments": {"command": '
             '"mkdir -p a/{b,c} && echo \\"}\\""}}\n</tool_call>\n'
             '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>')


def _outputs(pieces_per_choice, reason="stop"):
    """Interleaved outputs of several choices; the last of each is finished."""
    items = []
    longest = max(len(p) for p in pieces_per_choice)
    for k in range(longest):
        for i, pieces in enumerate(pieces_per_choice):
            if k < len(pieces):
                last = k == len(pieces) - 1
                items.append((i, RequestOutput(
                    request_id=f"r-{i}", text=pieces[k], finished=last,
                    finish_reason=reason if last else None, num_prompt_tokens=5,
                    num_completion_tokens=k + 1,
                    timings=RequestTimings(10, 11, 12, 13) if last else None,
                    reuse={"outcome": "NoMatch", "matched_tokens": 0, "reused_tokens": 0}
                    if last else None)))

    async def gen():
        for item in items:
            yield item
    return gen()


def _run(pieces_per_choice, include_usage=False, reason="stop"):
    n = len(pieces_per_choice)
    builder = ChunkBuilder("chat", "chatcmpl-x", "m", 0, None, include_usage)

    async def go():
        return [e async for e in sse_stream(_outputs(pieces_per_choice, reason), builder, n,
                                            [HermesParser(TOOLS) for _ in range(n)])]
    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def _reassemble(chunks, n):
    content, calls, finish = [""] * n, [{} for _ in range(n)], [None] * n
    for ch in chunks:
        for c in ch["choices"]:
            i, delta = c["index"], c["delta"]
            content[i] += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                entry = calls[i].setdefault(tc["index"], {"id": None, "name": None,
                                                          "arguments": ""})
                if "id" in tc:
                    assert entry["id"] is None, "id sent twice"
                    assert tc["type"] == "function" and "name" in tc["function"]
                    entry["id"], entry["name"] = tc["id"], tc["function"]["name"]
                else:
                    assert entry["id"] is not None, "arguments before the call's first delta"
                entry["arguments"] += tc["function"].get("arguments", "")
            if c["finish_reason"] is not None:
                finish[i] = c["finish_reason"]
    return content, [[calls[i][k] for k in sorted(calls[i])] for i in range(n)], finish


def test_two_calls_streamed_as_indexed_deltas():
    pieces = [TWO_CALLS[i:i + 7] for i in range(0, len(TWO_CALLS), 7)]
    chunks = _run([pieces])
    content, calls, finish = _reassemble(chunks, 1)
    assert content == ["Sure."] and finish == ["tool_calls"]
    assert [c["name"] for c in calls[0]] == TOOLS
    assert len({c["id"] for c in calls[0]}) == 2
    assert json.loads(calls[0][0]["arguments"]) == {"command": 'mkdir -p a/{b,c} && echo "}"'}
    assert calls[0][1]["arguments"] == "{}"
    assert not any("<tool_call" in (c["delta"].get("content") or "")
                   for ch in chunks for c in ch["choices"])
    # equals the non-streamed parse of the same text
    whole = HermesParser(TOOLS).parse(TWO_CALLS)
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls[0]]


def test_n2_each_choice_has_its_own_calls_and_finish():
    plain = ["Hello", " there"]
    chunks = _run([[TWO_CALLS[:50], TWO_CALLS[50:]], plain])
    content, calls, finish = _reassemble(chunks, 2)
    assert finish == ["tool_calls", "stop"]
    assert content == ["Sure.", "Hello there"] and calls[1] == []


def test_malformed_output_is_content_and_stop():
    broken = '<tool_call>\n{"name": "run_shell", "arguments": {"command": }}\n</tool_call>'
    content, calls, finish = _reassemble(_run([[broken[:20], broken[20:]]]), 1)
    assert content == [broken] and calls == [[]] and finish == ["stop"]


def test_cut_by_length_keeps_length():
    content, calls, finish = _reassemble(_run([[TWO_CALLS[:-20]]], reason="length"), 1)
    assert finish == ["length"] and [c["name"] for c in calls[0]] == ["run_shell"]
    assert content[0].startswith("Sure.<tool_call>")  # the cut call is content, raw


def test_flare_extension_on_last_chunk_only():
    chunks = _run([["a"], ["b", "c"]])
    with_ext = [ch for ch in chunks if "flare" in ch]
    assert with_ext == [chunks[-1]]
    ext = chunks[-1]["flare"]
    assert [c["index"] for c in ext["choices"]] == [0, 1]
    assert ext["choices"][1] == {
        "index": 1, "request_id": "r-1", "clock": "server_monotonic_ns",
        "timings": {"arrival_ns": 10, "scheduled_ns": 11, "first_token_ns": 12,
                    "finished_ns": 13},
        "reuse": {"outcome": "NoMatch", "matched_tokens": 0, "reused_tokens": 0}}


def test_flare_extension_rides_the_usage_chunk():
    chunks = _run([["a"]], include_usage=True)
    assert chunks[-1]["choices"] == [] and "usage" in chunks[-1] and "flare" in chunks[-1]
    assert all("flare" not in ch for ch in chunks[:-1])


def test_strict_cut_after_a_call_ends_with_tool_calls_api_tool_required_parallel_default():
    """A forced answer cut by max_tokens inside its second call: the complete call, no
    content, finish_reason tool_calls."""
    cut = TWO_CALLS[len("Sure.\n"):-20]
    builder = ChunkBuilder("chat", "chatcmpl-x", "m", 0, None, False)

    async def go():
        return [e async for e in sse_stream(_outputs([[cut[:33], cut[33:]]], "length"),
                                            builder, 1, [HermesParser(TOOLS, strict=True)])]
    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(go())[:-1]]
    content, calls, finish = _reassemble(chunks, 1)
    assert content == [""] and finish == ["tool_calls"]
    assert [c["name"] for c in calls[0]] == ["run_shell"]
