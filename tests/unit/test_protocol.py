"""Request validation: what is accepted, and 400 bodies that name the parameter at fault."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flare.server.api_error import ApiError, validation_error
from flare.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from flare.server.openai.replies import Usage

BASE = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def _chat(**kw):
    return ChatCompletionRequest.model_validate({**BASE, **kw})


def _error(cls, body) -> ApiError:
    with pytest.raises(ValidationError) as exc:
        cls.model_validate(body)
    err = validation_error(exc.value.errors())
    assert err.status_code == 400
    assert err.body()["error"]["type"] == "invalid_request_error"
    return err


def _chat_error(**kw) -> ApiError:
    return _error(ChatCompletionRequest, {**BASE, **kw})


def test_minimal_chat_defaults():
    req = _chat()
    assert req.n == 1 and not req.stream and not req.include_usage
    assert req.requested_max_tokens is None
    p = req.sampling_params(max_tokens=10)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (
        10, 1.0, 1.0, 0, None, ())


def test_sampling_params_mapping_and_seed_per_choice():
    req = _chat(temperature=0, top_p=0.9, top_k=-1, seed=7, stop="END", ignore_eos=True,
                max_completion_tokens=5, presence_penalty=0, frequency_penalty=0.0)
    assert req.requested_max_tokens == 5
    p0, p1 = req.sampling_params(5, 0), req.sampling_params(5, 1)
    assert (p0.temperature, p0.top_p, p0.top_k, p0.stop, p0.ignore_eos) == (
        0.0, 0.9, 0, ("END",), True)
    assert (p0.seed, p1.seed) == (7, 8)


def test_logprobs_and_penalties_reach_the_sampling_params():
    p = _chat(logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=-1,
              repetition_penalty=1.3).sampling_params(5)
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        3, 0.5, -1.0, 1.3)
    assert _chat(logprobs=True).sampling_params(5).logprobs == 0
    assert _chat(logprobs=False).sampling_params(5).logprobs is None
    p = _chat().sampling_params(5)
    assert (p.logprobs, p.penalized) == (None, False)
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 0})
    assert comp.sampling_params(5).logprobs == 0


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"n": "2"}, "n"),
    ({"seed": "7"}, "seed"),
    ({"logprobs": "true"}, "logprobs"),
    ({"top_p": None, "stop": ("a",)}, "stop"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
    ({"parallel_tool_calls": "false"}, "parallel_tool_calls"),
])
def test_wrong_json_types_are_400_naming_the_field_not_coerced(kw, param):
    err = _chat_error(**kw)
    assert err.param == param
    assert err.message.startswith(f"Invalid type for '{param}'"), err.message


def test_integers_stay_accepted_where_numbers_are_expected():
    req = _chat(temperature=1, top_p=1, presence_penalty=1, frequency_penalty=0,
                repetition_penalty=2)
    p = req.sampling_params(5)
    assert (p.temperature, p.top_p, p.presence_penalty, p.repetition_penalty) == (
        1.0, 1.0, 1.0, 2.0)
    assert isinstance(req.temperature, float)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_400(value):
    for field in ("temperature", "repetition_penalty", "presence_penalty"):
        assert _chat_error(**{field: value}).param == field


def test_tool_result_must_answer_an_earlier_tool_call():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    assert _chat(messages=ok).messages[2].tool_call_id == "c1"
    stray = ok[:2] + [{"role": "tool", "tool_call_id": "c2", "content": "r"}]
    err = _chat_error(messages=stray)
    assert err.param == "messages[2].tool_call_id"
    assert "'c2'" in err.message and "message 2" in err.message
    early = [ok[0], ok[2], ok[1]]  # the result before the call it answers
    assert _chat_error(messages=early).param == "messages[1].tool_call_id"


def test_content_parts_joined_and_extra_fields_ignored():
    req = _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}],
                store=False, metadata={"x": 1}, tool_choice="none", tools=[])
    assert req.messages[0].content == "a\nb"


def test_stream_options_usage():
    assert _chat(stream=True, stream_options={"include_usage": True}).include_usage
    err = _chat_error(stream_options={"include_usage": True})
    assert err.param == "stream_options" and "stream" in err.message


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"seed": 2**64}, "seed", "less than or equal to"),  # break-it: killed the engine
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": 5}, "stop", "valid string"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "greater than or equal to -2"),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logit_bias": {"a": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"-1": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"1": 101}}, "logit_bias", "[-100, 100]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
         "1-64 characters"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "conflicts"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'user'"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "required"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "valid string"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "only 'text' parts",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
            "messages[0].tool_calls[0].function",
            "Missing",
        ),
    ],
)
def test_chat_invalid_params_name_the_param(kw, param, words):
    err = _chat_error(**kw)
    assert err.param == param
    assert words in err.message
    assert param in err.message


def test_missing_required_fields():
    err = _error(ChatCompletionRequest, {"messages": BASE["messages"]})
    assert err.param == "model" and "Missing" in err.message
    err = _error(ChatCompletionRequest, {"model": "m"})
    assert err.param == "messages"


def test_fastapi_style_locations_and_invalid_json():
    # FastAPI prefixes body errors with "body".
    err = validation_error([{"type": "x", "loc": ("body", "messages", 2, "content"), "msg": "bad"}])
    assert err.param == "messages[2].content"
    err = validation_error(
        [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
          "ctx": {"error": "Expecting value"}}]
    )
    assert err.param is None and "Invalid JSON" in err.message and err.code == "invalid_json"


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[3]]}).prompt == [3]


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"prompt": ["a", "b"]}, "prompt", "one prompt"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": 3}, "prompt", "valid"),
        ({"prompt": "x", "echo": True}, "echo", "not supported"),
        ({"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"prompt": "x", "logprobs": 6}, "logprobs", "less than or equal to 5"),
        ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
        ({"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    ],
)
def test_completion_invalid_params(kw, param, words):
    err = _error(CompletionRequest, {"model": "m", **kw})
    assert err.param == param and words in err.message


def test_error_body_shape():
    err = ApiError(404, "no such model", param="model", code="model_not_found")
    assert err.body() == {"error": {"message": "no such model", "type": "invalid_request_error",
                                    "param": "model", "code": "model_not_found"}}


def test_usage_totals():
    u = Usage.of(prompt_tokens=10, completion_tokens=3, cached_tokens=4).model_dump()
    assert u == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                 "prompt_tokens_details": {"cached_tokens": 4}}
