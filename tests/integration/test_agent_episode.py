"""A scripted coding-agent episode over each API surface (issue 19): OpenAI chat
completions, Anthropic messages, OpenAI responses, each with its official SDK against real
`flare serve` processes on the embedded model (greedy).

The episode: a task ("the test fails: find and fix the bug"), then 8 tool-using turns and a
final answer. The script fixes each turn's tool choice (a named tool, "required" with
parallel calls at their default, "required" with one call, then auto); the model picks the
arguments, and a small fake workspace (`Workspace`) answers each call deterministically;
its results are fed back as the surface does (`tool` messages, `tool_result` blocks,
`function_call_output` items by previous_response_id).

For every turn of every surface:
- the arguments of each call are valid for the tool's schema made strict (no property the
  schema does not list; required ones present): cases api-tool-no-params (a tool without
  parameters gets `{}`) and api-tool-choice-modes;
- a forced answer ends with complete calls and the surface's tool-call finish reason, no
  markup in the text (case api-tool-required-parallel-default);
- the reused prompt tokens grow turn by turn and cover at least the previous turn's prompt
  (its full pages);
- the output (text, calls, finish reason, token counts) equals that of a server run with
  `--no-prefix-cache` given the same history (reuse == recompute).

Lean for CI: one server with the prefix cache and one without for the module, at most 64
tokens a call turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
from anthropic_replies import anthropic_message, text_and_tool_uses
from server_process import ServerProcess

from flare.server.grammar import parameters_schema

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

PAGE = 16  # the smollm2_package's page size (tests/conftest.py)
CALL_TOKENS = 64
ANSWER_TOKENS = 16
GREEDY = {"temperature": 0}

FILES = ("calc.py", "test_calc.py", "README.md")
START = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
    "README.md": "A tiny calculator.\n",
}
TASK = ("The test in test_calc.py fails. Use the tools to find the bug in calc.py, fix it, "
        "and run the tests again.")
# one per surface, so that no episode reuses another's prompts on the shared server
SYSTEM = "You are a coding agent ({}) working in a small Python repository."

# name -> (description, parameters): no additionalProperties anywhere (strict adds it)
TOOL_SPECS = {
    "list_files": ("List the files of the repository", {"type": "object", "properties": {}}),
    "read_file": ("Read a file", {
        "type": "object", "properties": {"path": {"type": "string", "enum": list(FILES)}},
        "required": ["path"]}),
    "run_tests": ("Run the test suite", {
        "type": "object", "properties": {"path": {"type": "string", "enum": ["test_calc.py"]}}}),
    "edit_file": ("Replace text in a file", {
        "type": "object",
        "properties": {"path": {"type": "string", "enum": list(FILES)},
                       "old": {"type": "string", "maxLength": 24},
                       "new": {"type": "string", "maxLength": 24}},
        "required": ["path", "old", "new"]}),
    "search": ("Find lines containing a word", {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 16}},
        "required": ["query"]}),
}
STRICT = {name: parameters_schema(params) for name, (_, params) in TOOL_SPECS.items()}

# (mode, tool): "named" forces that tool; "required" any tool, parallel calls allowed;
# "single" any tool, one call; "auto" the model's free choice, the final turn (tools stay
# in the prompt: tool_choice none would leave them out and change the prompt's start)
SCRIPT = [("named", "list_files"), ("named", "read_file"), ("named", "run_tests"),
          ("required", None), ("named", "read_file"), ("named", "edit_file"),
          ("named", "run_tests"), ("single", None), ("auto", None)]
TOOL_TURNS = sum(mode != "auto" for mode, _ in SCRIPT)
assert TOOL_TURNS >= 8


class Workspace:
    """The fake repository the tools act on (deterministic answers)."""

    def __init__(self) -> None:
        self.files = dict(START)

    def run(self, name: str, args: dict[str, Any]) -> str:
        if name == "list_files":
            return "\n".join(sorted(self.files))
        if name == "read_file":
            return self.files.get(args["path"], f"error: no file {args['path']}")
        if name == "run_tests":
            if "a + b" in self.files["calc.py"]:
                return "1 passed"
            return "FAILED test_calc.py::test_add - assert add(2, 3) == 5 (got -1)"
        if name == "edit_file":
            text = self.files.get(args["path"])
            if text is None or not args["old"] or args["old"] not in text:
                return f"error: {args['old']!r} not found in {args['path']}"
            self.files[args["path"]] = text.replace(args["old"], args["new"], 1)
            return f"edited {args['path']}"
        if name == "search":
            hits = [f"{p}:{i + 1}: {line}" for p, t in sorted(self.files.items())
                    for i, line in enumerate(t.splitlines()) if args["query"] in line]
            return "\n".join(hits) or "no match"
        raise AssertionError(f"unknown tool {name}")


@dataclass
class Turn:
    """One reply, as the test compares it across servers."""

    reason: str  # the surface's own finish / stop reason, or a response's status
    text: str
    calls: list[tuple[str, str, dict[str, Any]]]  # (id, name, arguments)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    def same_output(self) -> tuple:
        return (self.reason, self.text, [(n, a) for _, n, a in self.calls],
                self.prompt_tokens, self.completion_tokens)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def servers(smollm2_package, tmp_path_factory):
    """(server with the prefix cache, server without it)."""
    logs = tmp_path_factory.mktemp("episode-logs")
    warm = ServerProcess(smollm2_package, logs / "cache.log")
    try:
        cold = ServerProcess(smollm2_package, logs / "no-cache.log", ("--no-prefix-cache",))
    except BaseException:
        warm.stop()
        raise
    yield warm, cold
    cold.stop()
    warm.stop()


def _openai(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _anthropic(url: str):
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(servers):
    return _openai(servers[0].url).models.list().data[0].id


# --------------------------------------------------------------------------- checks


def _check_turn(k: int, mode: str, tool: str | None, turn: Turn, call_reason: str) -> None:
    """What every surface's reply to script step `k` must be."""
    where = f"turn {k} ({mode} {tool or ''})"
    if mode == "auto":  # free: text or calls, whatever the model chose
        assert turn.text or turn.calls, where
        return
    assert turn.calls, f"{where}: no call: {turn}"
    assert turn.reason == call_reason, f"{where}: {turn}"
    assert "<tool_call>" not in turn.text and "</tool_call>" not in turn.text, where
    if mode == "named":
        assert [n for _, n, _ in turn.calls] == [tool], where
    if mode in ("named", "single"):
        assert len(turn.calls) == 1, where
    for _, name, args in turn.calls:
        jsonschema.validate(args, STRICT[name])  # strict: nothing the schema does not list
        if name == "list_files":
            assert args == {}, where  # case api-tool-no-params


def _check_reuse(turns: list[Turn]) -> None:
    """Reused tokens grow turn by turn and cover the previous prompt's full pages."""
    assert turns[0].cached_tokens < turns[0].prompt_tokens
    for k in range(1, len(turns)):
        prev, cur = turns[k - 1], turns[k]
        assert cur.cached_tokens > prev.cached_tokens, (k, prev, cur)
        assert cur.cached_tokens >= prev.prompt_tokens // PAGE * PAGE, (k, prev, cur)
        assert cur.cached_tokens < cur.prompt_tokens, (k, cur)


def _check_cold(turns: list[Turn], cold: list[Turn]) -> None:
    """Every turn equals the --no-prefix-cache server's, which reused nothing."""
    assert len(cold) == len(turns)
    for k, (a, b) in enumerate(zip(turns, cold)):
        assert b.cached_tokens == 0, (k, b)
        assert a.same_output() == b.same_output(), (k, a, b)


# --------------------------------------------------------------------------- chat


def _chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
            for n, (d, p) in TOOL_SPECS.items()]


def _chat_choice(mode: str, tool: str | None) -> dict[str, Any]:
    if mode == "named":
        return {"tool_choice": {"type": "function", "function": {"name": tool}}}
    if mode == "single":
        return {"tool_choice": "required", "parallel_tool_calls": False}
    return {"tool_choice": mode}


def _chat_turn(client, model: str, messages: list, mode: str, tool: str | None) -> Turn:
    r = client.chat.completions.create(
        model=model, messages=messages, tools=_chat_tools(), **_chat_choice(mode, tool),
        max_tokens=ANSWER_TOKENS if mode == "auto" else CALL_TOKENS, temperature=0)
    (choice,) = r.choices
    calls = [(c.id, c.function.name, json.loads(c.function.arguments))
             for c in choice.message.tool_calls or ()]
    return Turn(choice.finish_reason, choice.message.content or "", calls,
                r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens,
                r.usage.completion_tokens)


def test_chat_completions_episode(servers, model):
    warm, cold = (_openai(s.url) for s in servers)
    ws = Workspace()
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM.format("chat")},
                                      {"role": "user", "content": TASK}]
    turns, cold_turns = [], []
    for k, (mode, tool) in enumerate(SCRIPT):
        turn = _chat_turn(warm, model, messages, mode, tool)
        cold_turns.append(_chat_turn(cold, model, messages, mode, tool))
        _check_turn(k, mode, tool, turn, "tool_calls")
        turns.append(turn)
        if not turn.calls:
            break
        messages.append({"role": "assistant", "content": turn.text or None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in turn.calls]})
        messages += [{"role": "tool", "tool_call_id": i, "content": ws.run(n, a)}
                     for i, n, a in turn.calls]
    assert len(turns) == len(SCRIPT)
    _check_reuse(turns)
    _check_cold(turns, cold_turns)


# --------------------------------------------------------------------------- anthropic


def _anthropic_tools() -> list[dict[str, Any]]:
    return [{"name": n, "description": d, "input_schema": p} for n, (d, p) in TOOL_SPECS.items()]


def _anthropic_choice(mode: str, tool: str | None) -> dict[str, Any]:
    if mode == "named":
        return {"type": "tool", "name": tool}
    if mode == "single":
        return {"type": "any", "disable_parallel_tool_use": True}
    return {"type": "any" if mode == "required" else "auto"}


def _anthropic_turn(client, model: str, messages: list, mode: str, tool: str | None,
                    stream: bool) -> Turn:
    kw = dict(model=model, system=SYSTEM.format("messages"), messages=messages, tools=_anthropic_tools(),
              tool_choice=_anthropic_choice(mode, tool),
              max_tokens=ANSWER_TOKENS if mode == "auto" else CALL_TOKENS, extra_body=GREEDY)
    r = anthropic_message(client, stream, **kw)
    text, uses = text_and_tool_uses(r)
    calls = [(b.id, b.name, b.input) for b in uses]
    u = r.usage
    return Turn(r.stop_reason, text, calls, u.input_tokens + u.cache_read_input_tokens,
                u.cache_read_input_tokens, u.output_tokens,
                {"content": [b.model_dump(exclude_none=True) for b in r.content]})


def test_anthropic_messages_episode(servers, model):
    """Odd turns streamed (`client.messages.stream`) on the cached server."""
    warm, cold = (_anthropic(s.url) for s in servers)
    ws = Workspace()
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    turns, cold_turns = [], []
    for k, (mode, tool) in enumerate(SCRIPT):
        turn = _anthropic_turn(warm, model, messages, mode, tool, stream=k % 2 == 1)
        cold_turns.append(_anthropic_turn(cold, model, messages, mode, tool, stream=False))
        _check_turn(k, mode, tool, turn, "tool_use")
        turns.append(turn)
        if not turn.calls:
            break
        messages.append({"role": "assistant", "content": turn.extra["content"]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": i, "content": ws.run(n, a)}
            for i, n, a in turn.calls]})
    assert len(turns) == len(SCRIPT)
    _check_reuse(turns)
    _check_cold(turns, cold_turns)


# --------------------------------------------------------------------------- responses


def _responses_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "name": n, "description": d, "parameters": p}
            for n, (d, p) in TOOL_SPECS.items()]


def _responses_choice(mode: str, tool: str | None) -> dict[str, Any]:
    if mode == "named":
        return {"tool_choice": {"type": "function", "name": tool}}
    if mode == "single":
        return {"tool_choice": "required", "parallel_tool_calls": False}
    return {"tool_choice": mode}


def _responses_turn(client, model: str, items: Any, previous: str | None, mode: str,
                    tool: str | None, stream: bool) -> Turn:
    kw = dict(model=model, input=items, tools=_responses_tools(), **_responses_choice(mode, tool),
              max_output_tokens=ANSWER_TOKENS if mode == "auto" else CALL_TOKENS,
              temperature=0)
    kw.update({"previous_response_id": previous} if previous
              else {"instructions": SYSTEM.format("responses")})
    if stream:
        with client.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    calls = [(o.call_id, o.name, json.loads(o.arguments)) for o in r.output
             if o.type == "function_call"]
    u = r.usage
    return Turn(r.status, r.output_text, calls, u.input_tokens,
                u.input_tokens_details.cached_tokens, u.output_tokens,
                {"id": r.id, "continuation": r.model_extra["flare"]["continuation"]})


def test_responses_episode(servers, model):
    """Each turn sends only its function_call_output items, by previous_response_id, on
    both servers (the cold one recomputes the same stored conversation); odd turns
    streamed on the cached server."""
    warm, cold = (_openai(s.url) for s in servers)
    ws, ws_cold = Workspace(), Workspace()
    items: Any = TASK
    cold_items: Any = TASK
    previous = cold_previous = None
    turns, cold_turns = [], []
    for k, (mode, tool) in enumerate(SCRIPT):
        turn = _responses_turn(warm, model, items, previous, mode, tool, stream=k % 2 == 1)
        other = _responses_turn(cold, model, cold_items, cold_previous, mode, tool,
                                stream=False)
        cold_turns.append(other)
        _check_turn(k, mode, tool, turn, "completed")
        assert other.same_output() == turn.same_output(), (k, turn, other)  # before going on
        turns.append(turn)
        if k > 0:
            assert turn.extra["continuation"] in ("exact", "rerendered"), turn
        if not turn.calls:
            break
        previous, cold_previous = turn.extra["id"], other.extra["id"]
        items = [{"type": "function_call_output", "call_id": i, "output": ws.run(n, a)}
                 for i, n, a in turn.calls]
        cold_items = [{"type": "function_call_output", "call_id": i,
                       "output": ws_cold.run(n, a)} for i, n, a in other.calls]
    assert len(turns) == len(SCRIPT)
    _check_reuse(turns)
    _check_cold(turns, cold_turns)
    exact = [t for t in turns[1:] if t.extra["continuation"] == "exact"]
    assert exact, "no turn continued the stored state exactly"
