"""The Responses API (/v1/responses) end to end with the official `openai` client, against
real `flare serve` processes on 127.0.0.1 serving the embedded model (greedy, short
outputs): plain and streamed responses, a function-call loop, a conversation continued
by previous_response_id (reusing the stored state, equal to a server that recomputes
everything, also after a restart on the same state folder), forks, GET, DELETE and 404s.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER, "strict": True}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
          "required": ["answer"], "additionalProperties": False}
INSTRUCTIONS = "You are a terse assistant."
TURNS = ["Name a fruit.", "What colour is it?", "Name another one.", "Which is sweeter?",
         "Say goodbye."]


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-state")


@pytest.fixture(scope="module")
def server(smollm2_package, state_dir, tmp_path_factory):
    """The main server; `test_restart...` stops it and starts a second on its folder."""
    logs = tmp_path_factory.mktemp("responses-logs")
    srv = ServerProcess(smollm2_package, logs / "a.log", ("--state-dir", str(state_dir)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return _client(server.url)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _create(client, model, **kw):
    return client.responses.create(model=model, temperature=0, **kw)


def _flare(response) -> dict:
    return response.model_extra["flare"]


def test_plain_and_streamed_text_are_equal(client, model):
    kw = dict(input="Write one sentence about the sea.", max_output_tokens=24)
    plain = _create(client, model, **kw)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.output[0].type == "message" and plain.output[0].role == "assistant"
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0
    assert plain.usage.total_tokens == plain.usage.input_tokens + plain.usage.output_tokens
    assert plain.usage.output_tokens_details.reasoning_tokens == 0

    events = list(_create(client, model, stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete"
                          else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_stream_helper_and_json_schema_format(client, model):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                      "strict": True}}
    with client.responses.stream(model=model, temperature=0, max_output_tokens=40,
                                 input="What is the capital of France? Answer in JSON.",
                                 text=fmt) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), ANSWER)
    plain = _create(client, model, max_output_tokens=40, text=fmt,
                    input="What is the capital of France? Answer in JSON.")
    assert plain.output_text == final.output_text
    obj = _create(client, model, max_output_tokens=16, text={"format": {"type": "json_object"}},
                  input="Give me a JSON object.")
    assert obj.output_text.startswith("{")  # a JSON object, cut or complete


def test_function_call_loop(client, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _create(client, model, input=ask, tools=TOOLS, max_output_tokens=48,
                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed"
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER)

    events = list(_create(client, model, input=ask, tools=TOOLS, max_output_tokens=48,
                          stream=True, tool_choice={"type": "function", "name": "get_weather"}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    assert events[-1].type == "response.completed"

    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"city": args["city"], "temperature": 21})}
    # the whole history as items (output items sent back as the SDK gives them)...
    full = _create(client, model, tools=TOOLS, max_output_tokens=24, store=False,
                   input=ask + [o.model_dump(exclude_none=True) for o in first.output] + [result])
    # ... and the same turn continuing the stored response: the same greedy answer
    cont = _create(client, model, tools=TOOLS, max_output_tokens=24,
                   previous_response_id=first.id, input=[result])
    assert cont.output_text == full.output_text and cont.output_text
    assert _flare(cont)["continuation"] == "exact"
    assert cont.usage.input_tokens == full.usage.input_tokens
    assert cont.usage.input_tokens_details.cached_tokens >= (
        first.usage.input_tokens + first.usage.output_tokens - 1)


def test_get_delete_and_errors(server, client, model):
    from openai import BadRequestError, NotFoundError

    r = _create(client, model, input="Say yes.", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    session = httpx.get(f"{server.url}/v1/sessions/{r.id}", timeout=10)
    assert session.status_code == 200 and session.json()["tokens"] > 0
    deleted = httpx.delete(f"{server.url}/v1/responses/{r.id}", timeout=10).json()
    assert deleted == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id),
                 lambda: client.responses.delete(r.id),
                 lambda: _create(client, model, input="x", previous_response_id=r.id)):
        with pytest.raises(NotFoundError) as e:
            call()
        assert set(e.value.body) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/v1/sessions/{r.id}", timeout=10).status_code == 404
    missing = httpx.get(f"{server.url}/v1/responses/resp_unknown", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
    unstored = _create(client, model, input="Say no.", max_output_tokens=4, store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    bad = [({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
           ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
           ({"input": "x", "tool_choice": "required"}, "tool_choice"),
           ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
           ({"input": "x", "background": True}, "background")]
    for fields, param in bad:
        with pytest.raises(BadRequestError) as e:
            _create(client, model, **fields)
        assert e.value.body["param"] == param, (fields, e.value.body)


def _history_items(turns: list[tuple[str, str]], new: str) -> list[dict]:
    items = []
    for user, answer in turns:
        items += [{"role": "user", "content": user},
                  {"type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": answer}]}]
    return items + [{"role": "user", "content": new}]


def _wait_saved(url: str, response_id: str) -> None:
    deadline = time.monotonic() + 120
    while httpx.get(f"{url}/v1/sessions/{response_id}", timeout=10).json()[
            "saved_tokens"] == 0:
        assert time.monotonic() < deadline, "the response's state was never saved"
        time.sleep(0.2)


def test_conversation_fork_and_restart_equal_recompute(server, client, model, smollm2_package,
                                                       state_dir, tmp_path):
    """Five turns by previous_response_id, each sending only its new message; a fork into
    two branches; the conversation continued after a restart on the same state folder;
    every answer equal to a --no-prefix-cache server given the whole history as items."""
    done: list[tuple[str, str]] = []  # (user message, answer) per turn
    prev = None
    chain = []
    for k, message in enumerate(TURNS):
        kw = {"previous_response_id": prev.id} if prev else {"instructions": INSTRUCTIONS}
        r = _create(client, model, input=message, max_output_tokens=12, **kw)
        assert r.previous_response_id == (prev.id if prev else None)
        if prev is not None:
            assert _flare(r)["continuation"] == "exact"
            covered = prev.usage.input_tokens + prev.usage.output_tokens - 1
            assert r.usage.input_tokens_details.cached_tokens >= covered, (k, r.usage)
        chain.append(r)
        done.append((message, r.output_text))
        prev = r

    # fork turn 2 into two branches; each continues; neither disturbs the other
    base = chain[1]
    branch_a = _create(client, model, previous_response_id=base.id, input="Tell me a joke.",
                       max_output_tokens=12)
    branch_b = _create(client, model, previous_response_id=base.id, input="Count to three.",
                       max_output_tokens=12)
    again_a = _create(client, model, previous_response_id=base.id, input="Tell me a joke.",
                      max_output_tokens=12)
    assert again_a.output_text == branch_a.output_text
    a2 = _create(client, model, previous_response_id=branch_a.id, input="Another one.",
                 max_output_tokens=12)
    assert a2.usage.input_tokens_details.cached_tokens >= (
        branch_a.usage.input_tokens + branch_a.usage.output_tokens - 1)
    assert client.responses.retrieve(branch_b.id).output_text == branch_b.output_text

    # restart on the same state folder: the stored chain continues, restored from disk
    _wait_saved(server.url, prev.id)
    server.stop()  # SIGTERM (a busy machine may need the SIGKILL after it: still fine)
    second = ServerProcess(smollm2_package, tmp_path / "b.log", ("--state-dir", str(state_dir)))
    try:
        c2 = _client(second.url)
        assert c2.responses.retrieve(prev.id).output_text == prev.output_text
        after = _create(c2, model, previous_response_id=prev.id, input="One more word.",
                        max_output_tokens=12)
        assert _flare(after)["continuation"] == "exact"
        assert after.usage.input_tokens_details.cached_tokens >= 16, after.usage
    finally:
        second.stop()

    cold = ServerProcess(smollm2_package, tmp_path / "c.log", ("--no-prefix-cache",))
    try:
        cc = _client(cold.url)
        for k in range(1, len(TURNS)):
            want = _create(cc, model, instructions=INSTRUCTIONS, max_output_tokens=12,
                           input=_history_items(done[:k], TURNS[k]), store=False)
            assert want.usage.input_tokens_details.cached_tokens == 0
            assert want.usage.input_tokens == chain[k].usage.input_tokens, k
            assert want.output_text == chain[k].output_text, k
        for branch, message in ((branch_a, "Tell me a joke."), (branch_b, "Count to three.")):
            want = _create(cc, model, instructions=INSTRUCTIONS, max_output_tokens=12,
                           input=_history_items(done[:2], message), store=False)
            assert want.output_text == branch.output_text
        want = _create(cc, model, instructions=INSTRUCTIONS, max_output_tokens=12,
                       input=_history_items(done, "One more word."), store=False)
        assert want.output_text == after.output_text
    finally:
        cold.stop()
