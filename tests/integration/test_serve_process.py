"""`flare serve` as a real process, driven over HTTP by the official `openai` client.

One server process (the session's `smollm2_package`, max_seq_len 2048) on a free port of
127.0.0.1 serves the module's tests; it is started by the same console script a user runs
and always terminated in the fixture's finalizer (SIGTERM, then SIGKILL). The last test
stops it with SIGTERM and checks the exit, so it must stay last in the file. One test
starts its own process: a copy of the package with one flipped weight byte, refused at
start-up.

Unlike tests/integration/test_server_api.py (uvicorn in a thread of the test process),
this covers the CLI, the package check and load at start-up, signal handling and exit
status.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time

import httpx
import openai
import pytest
from http_helpers import error_of, http_client_fixture, user, wait_state
from raw_sockets import read_until_closed
from server_process import EXIT_TIMEOUT_S, ServerProcess

from flare.serve_child import flare_command, free_port

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"  # the package's model name
CODE_PROMPT = "Write a Python function that reverses a string."
# Greedy answer of the embedded model is katakana: multi-byte characters in the stream.
MULTIBYTE_PROMPT = "Translate 'cat' into Japanese and Chinese."
# short connection limits, so the test of them is quick (the defaults are 10 s and 30 s)
HEADER_TIMEOUT_S = 3
BODY_TIMEOUT_S = 5




@pytest.fixture(scope="module")
def server(smollm2_package, tmp_path_factory):
    srv = ServerProcess(smollm2_package, tmp_path_factory.mktemp("serve") / "serve.log",
                        extra_args=("--header-timeout", str(HEADER_TIMEOUT_S),
                                    "--body-timeout", str(BODY_TIMEOUT_S)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


http = http_client_fixture(name="http", timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smollm2_package):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_package), local_files_only=True)


def _prompt_tokens(tokenizer, messages) -> int:
    """Tokens of the conversation rendered by the model's chat template (with the
    assistant header), tokenized without adding special tokens."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _counts(usage) -> tuple[int, int, int]:
    # cached_tokens may differ between two runs of one prompt (prefix reuse): not compared.
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def _idle(state: dict) -> bool:
    return state["num_running"] == 0 and state["num_waiting"] == 0


def _sequence_pages(state: dict) -> int:
    """Pages held by sequences: pages in use less those only the prefix cache keeps
    (`prefix_cache_pages`, 0 where the engine has no prefix cache). Exact when idle."""
    return state["pages_used"] - state.get("prefix_cache_pages", 0)


# --------------------------------------------------------------------------- API over HTTP


def test_models_and_health(client, http):
    assert http.get("/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream_usage_exact(client, tokenizer):
    messages = user(CODE_PROMPT)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                       max_tokens=24)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    # The greedy answer is longer than 24 tokens: it stops at the limit, exactly.
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, messages)
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_usage_chunk(client, tokenizer):
    messages = user(MULTIBYTE_PROMPT)
    kw = dict(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))

    content_chunks = [c for c in chunks if c.choices]
    usage_chunks = [c for c in chunks if not c.choices]
    assert content_chunks and all(c.usage is None for c in content_chunks)
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert usage_chunks[0].usage is not None
    assert _counts(usage_chunks[0].usage) == _counts(whole.usage)
    assert whole.usage.prompt_tokens == _prompt_tokens(tokenizer, messages)

    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content  # multi-byte characters intact
    assert any(ord(ch) > 127 for ch in text) and "\ufffd" not in text
    assert content_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])


def test_raw_stream_ends_with_done(http):
    body = {"model": MODEL, "messages": user("Say hi."), "temperature": 0,
            "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert [e for e in events if e == "data: [DONE]"] == [events[-1]]
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"] == [] and last["usage"]["total_tokens"] > 0


def test_disconnect_mid_stream_frees_pages(http, server):
    before = wait_state(http, _idle)
    assert _sequence_pages(before) == 0, before
    body = {"model": MODEL, "messages": user("Tell me a very long story."),
            "temperature": 0, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events, seen = 0, []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    seen.append(line[:300])
                if events >= 3:
                    break
            during = http.get("/debug/state").json()
            assert during["num_running"] == 1, (during, seen)
            assert _sequence_pages(during) > 0, during  # it holds pages of its own
        # leaving both blocks closed the connection with ~1,500 tokens still to go
    after = wait_state(http, lambda s: _idle(s) and _sequence_pages(s) == 0)
    assert after["pages_used"] + after["pages_free"] == after["pages_total"]
    assert after["requests_aborted_total"] == before["requests_aborted_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 1500


def test_errors_then_keeps_serving(client, http):
    # malformed JSON body
    r = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [',
                  headers={"content-type": "application/json"})
    assert error_of(r, 400, extra_fields_ok=True)["type"] == "invalid_request_error"

    # unknown model: 404 through the SDK too
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=user("hi"))
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    err = error_of(http.post("/v1/chat/completions",
                             json={"model": "no-such-model", "messages": user("hi")}), 404,
                   extra_fields_ok=True)
    assert "no-such-model" in err["message"]

    # a prompt of more than max_seq_len (2048) tokens: refused, never cut
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hello " * 2100))
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "2048" in e.value.message

    # negative max_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=-1)
    assert e.value.status_code == 400
    err = error_of(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": user("hi"), "max_tokens": -1}), 400, extra_fields_ok=True)
    assert err["param"] == "max_tokens"

    # still serving, and nothing left holding pages
    r = client.chat.completions.create(model=MODEL, messages=user("Say hi."),
                                       temperature=0, max_tokens=4)
    assert r.choices[0].message.content
    state = wait_state(http, _idle)
    assert _sequence_pages(state) == 0, state


# --------------------------------------------------------------------------- own processes


def test_slow_headers_and_bodies_are_cut_by_the_cli_timeouts(server, http):
    """`--header-timeout 3 --body-timeout 5` through the real CLI: headers never finished
    get 408 header_timeout, a body shorter than its Content-Length 408 body_timeout, each
    within a second or two of its limit and closed; the server serves on."""
    port = int(server.url.rsplit(":", 1)[1])
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: 500\r\n\r\n{\"model\"")
    for opening, code, limit in ((b"POST /v1/chat/completions HTTP/1.1\r\nhost",
                                  b"header_timeout", HEADER_TIMEOUT_S),
                                 (head, b"body_timeout", BODY_TIMEOUT_S)):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(opening)
            data, took = read_until_closed(s, 30)
        assert data.startswith(b"HTTP/1.1 408") and code in data, data[:300]
        assert limit - 0.5 < took < limit + 10, took
    assert http.get("/health").status_code == 200


def test_flipped_weight_byte_refused(smollm2_package, tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(smollm2_package, pkg)
    manifest = json.loads((pkg / "manifest.json").read_text())
    expected = manifest["payload"]["model.safetensors"]["sha256"]
    weights = pkg / "model.safetensors"
    weights.chmod(0o644)
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size - 1000)  # inside the tensor data, not the header
        byte = f.read(1)
        f.seek(size - 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    from flare.package.contract import sha256_file

    found = sha256_file(weights)
    assert found != expected

    proc = subprocess.run(
        [*flare_command(), "serve", str(pkg), "--host", "127.0.0.1",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # one line, no traceback
    assert "model.safetensors" in lines[0] and "sha256" in lines[0]
    assert expected in lines[0] and found in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_sigterm_exits_zero(server, http):
    """Runs last: it stops the module's server. A stream in flight when SIGTERM arrives
    is finished (graceful shutdown), then the process exits with status 0."""
    assert server.proc.poll() is None
    body = {"model": MODEL, "messages": user(CODE_PROMPT), "temperature": 0,
            "max_tokens": 48, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            server.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            rest = [line for line in lines if line]
    assert rest and rest[-1] == "data: [DONE]", rest[-3:]
    try:
        code = server.proc.wait(max(1.0, EXIT_TIMEOUT_S - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pytest.fail(f"flare serve still running {EXIT_TIMEOUT_S} s after SIGTERM:\n"
                    f"{server.log()}")
    assert code == 0, server.log()
