"""Logprobs, penalties, strict request types and tool-result ids over HTTP.

A real uvicorn server over the real engine and the embedded model (SmolLM2-135M, fp32).
Logprobs are checked against transformers' own forward of the same weights (built as in
tests/parity/test_llama_parity.py): a greedy answer's token logprobs equal `log_softmax` of
transformers' logits at those positions within 1e-4.
"""

from __future__ import annotations

import json

import pytest
import torch
from http_helpers import http_client_fixture
from server_thread import embedded_server_fixture

pytestmark = pytest.mark.slow

MODEL = "smollm2-logprobs"
MAX_SEQ_LEN = 512
ASK = [{"role": "user", "content": "List three colors."}]


server = embedded_server_fixture(max_seq_len=MAX_SEQ_LEN, model=MODEL, package_id="pkg-lp",
                                max_n=4)

client = http_client_fixture(timeout=120)


@pytest.fixture(scope="module")
def reference(embedded_checkpoint):
    """transformers' LlamaForCausalLM holding the embedded model's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = embedded_checkpoint
    cfg = AutoConfig.for_model(**ckpt.config.to_hf())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.load_state_dict(ckpt.tensors, strict=False)
    model.tie_weights()
    return model


def _chat(client, messages=ASK, **kw):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **kw})


def _events(response) -> list[dict]:
    blocks = [b for b in response.text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]"
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def _stream_logprobs(events, key: str) -> tuple[str, list]:
    """A choice-0 stream's text and its chunks' logprobs, joined."""
    text, joined = "", []
    for ev in events:
        for ch in ev["choices"]:
            text += ch["delta"].get("content") or "" if key == "content" else ch["text"]
            lp = ch["logprobs"]
            if lp is not None:
                joined += lp["content"] if key == "content" else [
                    dict(zip(("token", "logprob", "top", "offset"), row)) for row in zip(
                        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                        lp["text_offset"])]
    return text, joined


def _same(got, want) -> None:
    """Equal JSON, floats within 1e-5 (a prompt served from the prefix cache is computed
    in fewer, differently shaped steps: the last bits of a logit may differ)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-5)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        assert got == want


# --------------------------------------------------------------------------- logprobs


def test_chat_logprobs_equal_transformers_log_softmax(client, reference, embedded_checkpoint):
    from flare.server.chat import chat_prompt_ids
    from flare.server.logprobs import token_text

    tok = embedded_checkpoint.tokenizer
    r = _chat(client, temperature=0, max_tokens=10, logprobs=True, top_logprobs=3,
              ignore_eos=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 10 and choice["logprobs"]["refusal"] is None
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]

    prompt = chat_prompt_ids(tok, ASK)
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        ids = out[0].tolist()
        ref = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
    texts = token_text(tok)
    for i, (entry, token) in enumerate(zip(content, ids[len(prompt):])):
        row = ref[len(prompt) - 1 + i]
        assert entry["token"] == texts.text_of(token)
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["token"] == entry["token"]  # greedy: the argmax
        assert top[0]["logprob"] == entry["logprob"]
        assert [t["logprob"] for t in top] == pytest.approx(row.topk(3).values.tolist(),
                                                            abs=1e-4)


def test_chat_stream_logprobs_equal_non_stream(client):
    for kw in ({"stop": ["\n"], "temperature": 0}, {"n": 2, "seed": 3, "temperature": 0.9}):
        body = dict(max_tokens=16, logprobs=True, top_logprobs=2, **kw)
        whole = _chat(client, **body).json()
        events = _events(_chat(client, stream=True, **body))
        for i, choice in enumerate(whole["choices"]):
            mine = [{**ev, "choices": [c for c in ev["choices"] if c["index"] == i]}
                    for ev in events]
            text, joined = _stream_logprobs(mine, "content")
            assert text == choice["message"]["content"]
            _same(joined, choice["logprobs"]["content"])


def test_completion_logprobs_stream_equals_non_stream(client):
    body = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0,
            "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = whole["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 8
    assert "".join(lp["tokens"]) == whole["text"]
    assert [len(t) for t in lp["top_logprobs"]] == [2] * 8  # greedy: sampled is in the top
    assert all(max(t.values()) == v for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0
    assert all(whole["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
    text, joined = _stream_logprobs(
        _events(client.post("/v1/completions", json={**body, "stream": True})), "text")
    assert text == whole["text"]
    assert [j["token"] for j in joined] == lp["tokens"]
    _same([j["logprob"] for j in joined], lp["token_logprobs"])
    _same([j["top"] for j in joined], lp["top_logprobs"])
    assert [j["offset"] for j in joined] == lp["text_offset"]


def test_no_logprobs_unless_asked(client):
    body = _chat(client, temperature=0, max_tokens=4).json()
    assert body["choices"][0]["logprobs"] is None
    events = _events(_chat(client, temperature=0, max_tokens=4, stream=True))
    assert all(c["logprobs"] is None for ev in events for c in ev["choices"])


def test_openai_sdk_reads_logprobs(server):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=4,
                                      logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(c.token for c in content) == out.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    comp = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                  logprobs=1)
    assert len(comp.choices[0].logprobs.tokens) == 3


# --------------------------------------------------------------------------- penalties


def test_penalties_change_a_repeating_answer_and_zero_changes_nothing(client):
    body = {"model": MODEL, "prompt": "a a a a a a a a", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    zero = client.post("/v1/completions", json={
        **body, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
    }).json()["choices"][0]["text"]
    assert zero == plain
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2},
                    {"repetition_penalty": 3.0}):
        r = client.post("/v1/completions", json={**body, **penalty})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] != plain, penalty


def test_logit_bias_forces_and_bans_tokens_streaming_and_not(client, embedded_checkpoint):
    tok = embedded_checkpoint.tokenizer
    target = tok.encode(" banana", add_special_tokens=False)[0]
    body = {"max_tokens": 4, "temperature": 0, "logit_bias": {str(target): 100}}
    text = _chat(client, **body).json()["choices"][0]["message"]["content"]
    assert text == tok.decode([target] * 4)
    streamed = _chat(client, **body, stream=True)
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in _events(streamed)
              if e["choices"]]
    assert "".join(pieces) == text
    plain = _chat(client, max_tokens=1, temperature=0, logprobs=True).json()["choices"][0]
    first = plain["logprobs"]["content"][0]["token"]
    first_id = tok.convert_tokens_to_ids(tok.tokenize(first))[0]
    banned = _chat(client, max_tokens=1, temperature=0, logit_bias={str(first_id): -100})
    assert banned.json()["choices"][0]["message"]["content"] != plain["message"]["content"]
    vocab = len(tok)
    r = _chat(client, logit_bias={str(vocab): 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    assert str(vocab) in r.json()["error"]["message"]


# --------------------------------------------------------------------------- 400s


@pytest.mark.parametrize("kw, param, words", [
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"frequency_penalty": -3}, "frequency_penalty", "greater than or equal to -2"),
    ({"repetition_penalty": -1}, "repetition_penalty", "greater than 0"),
    ({"max_tokens": "5"}, "max_tokens", "Invalid type"),
    ({"temperature": "hot"}, "temperature", "Invalid type"),
    ({"stream": "yes"}, "stream", "Invalid type"),
    ({"logprobs": 1}, "logprobs", "Invalid type"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]},
     "messages[1].tool_call_id", "'call_9'"),
])
def test_invalid_requests_are_400_naming_the_field(client, kw, param, words):
    r = _chat(client, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and param in err["message"]


def test_completion_logprobs_above_5_and_ints_for_floats(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    r = _chat(client, temperature=1, top_p=1, max_tokens=2, seed=1, presence_penalty=1)
    assert r.status_code == 200, r.text
