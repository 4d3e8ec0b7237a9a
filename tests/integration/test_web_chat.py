"""The web chat at GET /, /docs offline and the request histograms on /metrics, against
one real `flare serve` process of the embedded model (with a disk tier).

The browser test drives the distribution's headless Chromium with Playwright (its own
browser download is not used): it skips when no `chromium` is on PATH, and fails instead
when FLARE_REQUIRE_BROWSER=1 (set by .ci/run). Every request the page makes to another
origin is refused and recorded, so the test also shows the page needs no internet.
Screenshots go to $FLARE_TEST_ARTIFACTS (default: a pytest temporary folder); their
paths are printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import flare
from http_helpers import http_client_fixture
from server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(smollm2_package, tmp_path_factory):
    folder = tmp_path_factory.mktemp("web")
    srv = ServerProcess(smollm2_package, folder / "serve.log",
                        ("--state-dir", str(folder / "state")))
    yield srv
    srv.stop()


http = http_client_fixture(name="http", timeout=120)


class _Assets(HTMLParser):
    """The script and style sheet URLs of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.urls.append(a["src"])
        href = a.get("href") or ""
        if tag == "link" and a.get("rel") in ("stylesheet", "icon") and not href.startswith(
                "data:"):
            self.urls.append(href)


def _assets(html: str) -> list[str]:
    parser = _Assets()
    parser.feed(html)
    return parser.urls


def _check_local_assets(http: httpx.Client, html: str, prefix: str) -> list[str]:
    urls = _assets(html)
    assert urls, "the page loads no scripts or styles"
    for url in urls:
        assert url.startswith(prefix), f"{url} is not served by flare under {prefix}"
        r = http.get(url)
        assert r.status_code == 200, f"{url}: {r.status_code}"
        assert len(r.content) > 100, url
    return urls


def test_page_and_its_assets_are_served_from_the_package(http):
    r = http.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    urls = _check_local_assets(http, r.text, "/web/")
    names = " ".join(urls)
    for lib in ("marked", "purify", "highlight", "app.js", "style.css"):
        assert lib in names
    assert "http://" not in r.text and "https://" not in r.text
    assert http.get("/web/vendor/marked/LICENSE").status_code == 200
    assert http.get("/web/nothing-here.js").status_code == 404


def test_docs_load_swagger_ui_from_local_assets(http):
    r = http.get("/docs")
    assert r.status_code == 200
    urls = _check_local_assets(http, r.text, "/web/vendor/swagger-ui/")
    assert any(u.endswith("swagger-ui-bundle.js") for u in urls)
    assert "cdn." not in r.text and "https://" not in r.text
    assert http.get("/openapi.json").json()["info"]["title"] == "Flare"
    assert http.get("/redoc").status_code == 404  # no vendored bundle: turned off


def _scrape(http: httpx.Client) -> dict[str, float]:
    """Samples of /metrics by name plus labels (histograms: _bucket, _sum, _count)."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            key = s.name + (f"{{{labels}}}" if labels else "")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            out[key] = s.value
    return out


HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens")


def test_histograms_count_and_sum_the_requests_sent(server, http, smollm2_package):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           timeout=120)
    before = _scrape(http)
    sent = []
    for i, question in enumerate(["Name a color.", "Name a fruit.", "Name a city.",
                                  "Name an animal.", "Name a planet."]):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12 + i,
            temperature=0, stream=True, stream_options={"include_usage": True})
        texts, usage, ext = 0, None, None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                texts += 1
            if chunk.usage is not None:
                usage = chunk.usage
                ext = chunk.model_extra["flare"]["choices"][0]["timings"]
        sent.append((texts, usage, ext))
    after = _scrape(http)

    def delta(name: str, part: str) -> float:
        key = f"flare_{name}_{part}"
        return after[key] - before.get(key, 0.0)

    for name in HISTOGRAMS:
        if name != "inter_token_latency_seconds":
            assert delta(name, "count") == 5, name
    # one inter-token observation per streamed text event after a request's first
    assert delta("inter_token_latency_seconds", "count") == sum(t - 1 for t, _, _ in sent)
    assert delta("request_prompt_tokens", "sum") == sum(u.prompt_tokens for _, u, _ in sent)
    assert delta("request_generation_tokens", "sum") == sum(
        u.completion_tokens for _, u, _ in sent)

    def total(a: str, b: str) -> float:  # seconds, from the responses' own server clock
        return sum((t[b] - t[a]) / 1e9 for _, _, t in sent)

    for name, a, b in (("time_to_first_token_seconds", "arrival_ns", "first_token_ns"),
                       ("e2e_request_latency_seconds", "arrival_ns", "finished_ns"),
                       ("request_queue_time_seconds", "arrival_ns", "scheduled_ns"),
                       ("request_prefill_time_seconds", "scheduled_ns", "first_token_ns"),
                       ("request_decode_time_seconds", "first_token_ns", "finished_ns")):
        assert delta(name, "sum") == pytest.approx(total(a, b), abs=1e-6), name
    assert delta("inter_token_latency_seconds", "sum") <= total("first_token_ns",
                                                                "finished_ns") + 0.5
    # vLLM's buckets
    assert "flare_time_to_first_token_seconds_bucket[le=2560.0]" in after
    assert "flare_inter_token_latency_seconds_bucket[le=80.0]" in after
    assert "flare_e2e_request_latency_seconds_bucket[le=7680.0]" in after
    assert "flare_request_prompt_tokens_bucket[le=2000.0]" in after  # 1-2-5 up to 2,048

    manifest = json.loads((smollm2_package / "manifest.json").read_text())
    from flare.kernels import isa_target, isa_variant

    info = {k: v for k, v in after.items() if k.startswith("flare_build_info{")}
    assert len(info) == 1 and list(info.values()) == [1.0]
    (key,) = info
    assert f"version={flare.__version__}" in key
    assert f"package_id={manifest['package_id']}" in key
    assert f"format={manifest['tuning']['weights']}" in key
    assert f"kernel_variant={isa_target(isa_variant())}" in key


# ------------------------------------------------------------------------- the browser

def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        why = ("no chromium on PATH: the browser test needs the distribution's package "
               "(apt-get install chromium); Playwright's own download is not used")
        if os.environ.get("FLARE_REQUIRE_BROWSER") == "1":
            pytest.fail(why + " (FLARE_REQUIRE_BROWSER=1)")
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = os.environ.get("FLARE_TEST_ARTIFACTS")
    path = Path(folder) / "web-chat" if folder else tmp_path_factory.mktemp("web-chat")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield b
        b.close()


# Records the streamed answer's length at each change of the page, to show it grew.
RECORD_STREAM = """
window.__streamLengths = [];
new MutationObserver(() => {
  const body = document.querySelector('.msg.assistant.streaming .body');
  if (body) window.__streamLengths.push(body.textContent.length);
}).observe(document, {subtree: true, childList: true, characterData: true});
localStorage.setItem('flare.web.settings', JSON.stringify({max_tokens: 40, temperature: 0}));
"""


def _shot(page, artifacts: Path, name: str, shots: list[Path]) -> None:
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path))
    shots.append(path)
    print(f"screenshot: {path}")


def _answers(page) -> list[str]:
    return [t.strip() for t in page.locator(".msg.assistant .body").all_inner_texts()]


def _wait_answers(page, n: int) -> None:
    page.wait_for_function(
        f"document.querySelectorAll('.msg.assistant.done').length === {n} && "
        f"!document.querySelector('.msg.streaming')", timeout=120_000)


def test_browser_chat_streams_branches_and_survives_a_reload(server, http, browser,
                                                             artifacts):
    external: list[str] = []
    context = browser.new_context(viewport={"width": 1100, "height": 720})

    def only_local(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:  # no internet: anything else would fail offline
            external.append(route.request.url)
            route.abort()

    context.route("**/*", only_local)
    context.add_init_script(RECORD_STREAM)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    shots: list[Path] = []

    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0")

    # turn 1: the streamed answer appears, growing
    page.fill("#input", "What is the capital of France?")
    page.press("#input", "Enter")
    _wait_answers(page, 1)
    first = _answers(page)[0]
    assert first, "no answer rendered"
    lengths = page.evaluate("window.__streamLengths")
    assert len(set(lengths)) >= 2 and min(lengths) < len(first), (
        f"the answer did not arrive in pieces: {lengths}")
    _shot(page, artifacts, "1-first-answer", shots)

    # turn 2 reuses the first turn's state: cached tokens > 0, from a named tier
    page.fill("#input", "Write a Python function that adds two numbers.")
    page.press("#input", "Enter")
    _wait_answers(page, 2)
    cached = page.locator(".msg.assistant").nth(1).locator(".stats .cached").inner_text()
    assert int(cached) > 0
    tier = page.locator(".msg.assistant").nth(1).locator(".stats .tier").inner_text()
    assert tier in ("device", "host", "disk")
    assert re.search(r"\d+ ms", page.locator(".msg.assistant").nth(1).locator(
        ".stats .ttft").inner_text())
    second = _answers(page)[1]
    session_a = page.inner_text("#session-name").removeprefix("session ")
    _shot(page, artifacts, "2-second-turn-cached", shots)

    # edit the first message: a new branch on a forked session
    page.locator(".msg.user").first.locator("button.edit").click()
    page.fill(".edit-box textarea", "Write a haiku about the sea.")
    page.click(".edit-box button.save-edit")
    _wait_answers(page, 1)
    assert page.locator(".msg.user").first.locator(".branch-pos").inner_text() == "2/2"
    branch = _answers(page)
    assert len(branch) == 1 and branch[0] and branch[0] != first
    session_b = page.inner_text("#session-name").removeprefix("session ")
    assert session_b != session_a
    for name in (session_a, session_b):  # both branches' states are server sessions
        s = http.get(f"/v1/sessions/{name}").json()
        assert s["tokens"] > 0, s
    _shot(page, artifacts, "3-edited-branch", shots)

    # switch: each branch shows its own answers
    page.locator(".msg.user").first.locator("button.prev").click()
    assert page.locator(".msg.user").first.locator(".branch-pos").inner_text() == "1/2"
    assert _answers(page) == [first, second]
    page.locator(".msg.user").first.locator("button.next").click()
    assert _answers(page) == branch

    # a reload finds the conversation, its branches and the server's state for it
    page.reload()
    page.wait_for_function("document.getElementById('model-name').textContent.length > 0")
    item = page.locator("#conversations li").first
    assert "What is the capital of France?" in item.inner_text()
    page.wait_for_function(
        "document.querySelector('#conversations li .conv-state').textContent.includes('tok')")
    assert _answers(page) == branch
    page.locator(".msg.user").first.locator("button.prev").click()
    assert _answers(page) == [first, second]
    page.wait_for_function("document.getElementById('st-pages').textContent.includes('used')")
    _shot(page, artifacts, "4-after-reload", shots)

    # stop a long answer mid-stream, then continue it on its own state
    page.evaluate("localStorage.setItem('flare.web.settings', "
                  "JSON.stringify({max_tokens: 300, temperature: 0}))")
    page.click("#new-chat")
    page.fill("#input", "Write a long story about a dragon who learns to cook.")
    page.press("#input", "Enter")
    page.wait_for_function("(document.querySelector('.msg.assistant.streaming .body') || "
                           "{textContent: ''}).textContent.length > 40", timeout=120_000)
    page.click("#stop")
    _wait_answers(page, 1)
    assert page.inner_text(".msg.assistant .finish") == "(stopped)"
    stopped = _answers(page)[0]
    length = page.evaluate("document.querySelector('.msg.assistant .body').textContent.length")
    page.click("#continue")
    page.wait_for_function(
        "!document.querySelector('.msg.streaming') && document.querySelector("
        f"'.msg.assistant.done .body').textContent.length > {length}", timeout=120_000)
    continued = _answers(page)[0]
    assert len(continued) > len(stopped) and continued.startswith(stopped[:40])
    assert int(page.locator(".msg.assistant .stats .cached").inner_text()) > 0
    _shot(page, artifacts, "5-stopped-and-continued", shots)

    assert not errors, errors
    assert not external, f"the page asked for other origins: {external}"
    context.close()


def test_browser_docs_render_offline(server, browser, artifacts):
    external: list[str] = []
    context = browser.new_context(viewport={"width": 1100, "height": 720})

    def only_local(route):
        if route.request.url.startswith(server.url):
            route.continue_()
        else:
            external.append(route.request.url)
            route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    page.goto(server.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title", timeout=60_000)
    assert "Flare" in page.inner_text(".swagger-ui .info .title")
    page.locator(".opblock-summary-path", has_text="/v1/chat/completions").first.wait_for()
    path = artifacts / "docs.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    assert not external, f"/docs asked for other origins: {external}"
    context.close()
