"""The readiness wait and the escalating stop of `flare.serve_child`, on real child
processes (a tiny HTTP server stands in for `flare serve`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from flare.serve_child import ServerStartError, free_port, stop_process, wait_healthy

HEALTH_SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""

DEAF_CHILD = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


def _child(code: str, *args: str, log=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=log,
                            stderr=subprocess.STDOUT if log else None)


def test_waits_until_health_answers(tmp_path):
    port = free_port()
    proc = _child(HEALTH_SERVER, str(port), "0.5")
    try:
        t0 = time.monotonic()
        wait_healthy(proc, f"http://127.0.0.1:{port}", tmp_path / "none.log", 30)
        assert time.monotonic() - t0 >= 0.4 and proc.poll() is None
    finally:
        assert stop_process(proc) == -signal.SIGTERM


def test_a_child_that_exits_is_an_error_with_its_log(tmp_path):
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = _child("import sys; print('no package here'); sys.exit(3)", log=log)
        with pytest.raises(ServerStartError, match=r"(?s)status 3 .*no package here"):
            wait_healthy(proc, f"http://127.0.0.1:{free_port()}", log_path, 30)


def test_no_answer_in_time_is_an_error_and_the_child_runs_on(tmp_path):
    proc = _child("import time; time.sleep(60)")
    try:
        with pytest.raises(ServerStartError, match="within 1 s"):
            wait_healthy(proc, f"http://127.0.0.1:{free_port()}", tmp_path / "x.log", 1)
        assert proc.poll() is None
    finally:
        stop_process(proc)


def test_stop_escalates_to_sigkill_when_the_signals_are_ignored():
    proc = subprocess.Popen([sys.executable, "-c", DEAF_CHILD], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"ready\n"  # the handlers are in place
    assert stop_process(proc, ((signal.SIGINT, 0.3), (signal.SIGTERM, 0.3))) == -signal.SIGKILL
    assert stop_process(proc) == -signal.SIGKILL  # already exited: its status, at once
    proc.stdout.close()
