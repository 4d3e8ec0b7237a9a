"""Progress in a non-terminal log (issue 20): whole lines with a percentage, never a
carriage-return bar; the kernel build reports its compiled sources the same way."""

from __future__ import annotations

import io
import logging
import threading
import time

from flare.progress import LineProgress, progress_bar


def test_progress_in_a_log_is_lines_with_percentages():
    out = io.StringIO()  # not a terminal
    bar = progress_bar(range(4), desc="dequantizing", unit="tensor", file=out, interval_s=0)
    assert isinstance(bar, LineProgress)
    assert list(bar) == [0, 1, 2, 3]
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split(": ")[1].split(" ")[0] for ln in lines] == ["25%", "50%", "75%", "100%"]
    assert lines[-1].startswith("dequantizing: 100% (4/4 tensors, in ")


def test_lines_come_at_most_every_interval():
    out = io.StringIO()
    with progress_bar(total=1000, desc="loading", unit="file", file=out,
                      interval_s=3600) as bar:
        for _ in range(1000):
            bar.update()
    assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
    assert out.getvalue().startswith("loading: 100% (1000/1000 files, in ")


def test_disabled_progress_prints_nothing():
    out = io.StringIO()
    assert list(progress_bar([1, 2], desc="x", disable=True, file=out)) == [1, 2]
    assert out.getvalue() == ""


def test_kernel_build_reports_compiled_sources_as_lines(tmp_path, caplog):
    from flare.kernels.build import SOURCES, report_build

    done = threading.Event()
    with caplog.at_level(logging.WARNING, logger="flare.kernels"):
        watcher = threading.Thread(target=report_build, args=(tmp_path, done, 0.02))
        watcher.start()
        time.sleep(0.1)
        (tmp_path / "qgemm.o").write_bytes(b"")
        (tmp_path / "dense.o").write_bytes(b"")
        deadline = time.monotonic() + 10
        while "2/" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        done.set()
        watcher.join(5)
    assert not watcher.is_alive()
    n = len(SOURCES)
    assert f"0% (0/{n} sources compiled" in caplog.text
    assert f"{200 // (n + 1)}% (2/{n} sources compiled" in caplog.text
    assert "\r" not in caplog.text
