"""Peak RSS of a serving process against the package's memory report (issue 9's target).

The target: peak RSS no more than the package's memory report plus 300 MiB. This prepares
(or reuses) a package of the embedded model (SmolLM2-135M) in the weight format asked for,
starts `flare serve PKG` on a free 127.0.0.1 port, sends a bounded chat workload through
the official `openai` client (some requests streamed, a few at once, one long prompt),
then reads the server's VmHWM (peak RSS) and VmRSS from /proc/<pid>/status and sets them
beside the manifest's "memory" report. Figures, not pass/fail.

    .venv/bin/python bench/bench_memory.py [--weights q4x8] [--requests 8]
        [--num-pages 1024] [--cache-dir DIR]

The package is kept under `--cache-dir` (default: the repo's .cache/flare-bench-memory),
one folder per weight format, and reused by later runs. The report's total counts the host
tier of endpoint states on CPU, but that tier is filled lazily (only when the prefix index
evicts pages), so a short workload never touches it: the table shows the total with and
without it. On CUDA the report is of device memory, and RSS is not the figure to hold it
against; this benchmark serves on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx
from openai import OpenAI

from flare.qualify.server import ManagedServer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "flare-bench-memory"
MIB = 1 << 20
TARGET_MIB = 300  # issue 9: peak RSS <= report + 300 MiB
LONG_PROMPT_TOKENS = 1500

PARAGRAPH = ("The service keeps a pool of key-value pages shared by every sequence; a "
             "request takes pages as its context grows and gives them back when it ends. "
             "Pages that several requests share are held once and counted once. ")


def prepare(cache_dir: Path, weights: str, num_pages: int) -> Path:
    """The embedded model's package for `weights` under `cache_dir` (reused when valid, as
    `flare serve --embedded` does); returns its folder."""
    from flare.loading.embedded import embedded_model_path
    from flare.prepare.package import ensure_package

    return ensure_package(embedded_model_path(), cache_dir, weights=weights,
                          num_pages=num_pages, progress=True)


def memory_report(package: Path) -> dict[str, int]:
    """The manifest's "memory" section (`MemoryReport.to_dict`): bytes."""
    return json.loads((package / "manifest.json").read_text())["memory"]


def proc_memory(pid: int) -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS of process `pid`, in bytes, from /proc/<pid>/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            value, unit = rest.split()
            assert unit == "kB", line
            out[key] = int(value) * 1024
    return out


def long_prompt(package: Path, tokens: int) -> str:
    """A user message of about `tokens` tokens of the package's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(package), local_files_only=True)
    per = len(tok(PARAGRAPH, add_special_tokens=False)["input_ids"])
    text = PARAGRAPH * max(1, tokens // per)
    return "Summarise the following notes in two sentences.\n\n" + text


def one_request(client: OpenAI, model: str, index: int, prompt: str, stream: bool,
                max_tokens: int) -> dict:
    """One chat request at temperature 0: {"index", "stream", "prompt_tokens",
    "completion_tokens", "seconds"} (tokens as the server's usage counts them)."""
    messages = [{"role": "user", "content": prompt}]
    t0 = time.monotonic()
    if stream:
        usage = None
        chunks = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True})
        for chunk in chunks:
            usage = chunk.usage or usage
    else:
        usage = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0).usage
    return {"index": index, "stream": stream,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "seconds": time.monotonic() - t0}


def workload(url: str, package: Path, requests: int, concurrency: int, max_tokens: int,
             request_timeout: float, deadline: float) -> list[dict]:
    """`requests` chat requests, `concurrency` at a time: request 0 carries the long prompt,
    odd ones are streamed. Each bounded by `request_timeout` s, all by `deadline` s; a
    failed or unfinished request is listed with its error."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=request_timeout,
                    max_retries=0)
    model = client.models.list().data[0].id
    prompts = [long_prompt(package, LONG_PROMPT_TOKENS)]
    prompts += [f"Question {i}: name three uses of a hash table, one line each."
                for i in range(1, requests)]
    pool = ThreadPoolExecutor(max_workers=concurrency)
    futures = [pool.submit(one_request, client, model, i, p, i % 2 == 1, max_tokens)
               for i, p in enumerate(prompts)]
    done, _ = wait(futures, timeout=deadline)
    pool.shutdown(wait=False, cancel_futures=True)
    rows = []
    for i, f in enumerate(futures):
        if f not in done:
            rows.append({"index": i, "error": f"not finished within {deadline:.0f} s"})
        elif f.exception() is not None:
            rows.append({"index": i, "error": repr(f.exception())[:160]})
        else:
            rows.append(f.result())
    return rows


class RssSampler(threading.Thread):
    """Samples VmRSS of `pid` every `interval` s; `peak` is the largest seen (bytes)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.peak = max(self.peak, proc_memory(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join(2)


def memory_metrics(url: str) -> list[str]:
    """The sample lines of the server's /metrics whose name mentions bytes."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return [f"(no /metrics: {exc!r})"]
    return [line for line in text.splitlines()
            if "bytes" in line and not line.startswith("#")]


def mib(nbytes: float) -> str:
    """Bytes as MiB, one decimal."""
    return f"{nbytes / MIB:.1f}"


def print_report(report: dict[str, int]) -> None:
    """The manifest's memory report, one field a line, in MiB."""
    print("memory report (manifest.json \"memory\"), MiB:")
    for key, label in (("weights_bytes", "weights"), ("kv_pool_bytes", "KV pool"),
                       ("state_pool_bytes", "state pool"), ("workspace_bytes", "workspace"),
                       ("graph_workspace_bytes", "  of which graphs"),
                       ("host_tier_bytes", "host tier (lazy)"),
                       ("disk_tier_bytes", "disk tier (on disk)"),
                       ("total_bytes", "total"), ("device_bytes", "device (RAM)")):
        if key in report:
            print(f"  {label:<22}{mib(report[key]):>10}")


def print_table(report: dict[str, int], loaded: dict[str, int], after: dict[str, int],
                sampled_peak: int) -> None:
    """The summary table: report totals against VmHWM / VmRSS (MiB)."""
    total = report["total_bytes"]
    no_host = total - report.get("host_tier_bytes", 0)
    hwm = after["VmHWM"]
    rows = [
        ("report total", total),
        ("report total w/o host tier", no_host),
        ("VmRSS after load (idle)", loaded["VmRSS"]),
        ("VmHWM after load (idle)", loaded["VmHWM"]),
        ("VmRSS after workload", after["VmRSS"]),
        ("  RssAnon / RssFile", None),
        ("VmRSS peak sampled (0.1 s)", sampled_peak),
        ("VmHWM after workload", hwm),
        ("VmHWM - report total", hwm - total),
        ("VmHWM - report w/o host tier", hwm - no_host),
    ]
    print(f"{'':<32}{'MiB':>10}")
    for label, value in rows:
        if value is None:
            print(f"{label:<32}{mib(after.get('RssAnon', 0)):>10} / "
                  f"{mib(after.get('RssFile', 0))}")
        else:
            print(f"{label:<32}{mib(value):>10}")
    for name, base in (("report total", total), ("report w/o host tier", no_host)):
        margin = base + TARGET_MIB * MIB - hwm
        print(f"within +{TARGET_MIB} MiB of {name}: {'yes' if margin >= 0 else 'no'} "
              f"(headroom {mib(margin)} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                    help="where packages are kept, one folder a weight format "
                         f"(default {DEFAULT_CACHE.relative_to(ROOT)})")
    ap.add_argument("--weights", choices=["full", "fp16", "q4", "q4x8"], default="fp16")
    ap.add_argument("--num-pages", type=int, default=1024, help="KV pages (as `make serve`)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds a request")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds for the workload")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds until /health (q4x8 may build its kernel first, ~2 min)")
    args = ap.parse_args()

    t0 = time.monotonic()
    package = prepare(args.cache_dir, args.weights, args.num_pages)
    print(f"package {package} ({time.monotonic() - t0:.0f} s), weights {args.weights}, "
          f"num_pages {args.num_pages}")
    report = memory_report(package)
    print_report(report)

    log_path = package.parent / "serve.log"
    server = ManagedServer(package, log_path, startup_timeout=args.startup_timeout)
    sampler = None
    try:
        t0 = time.monotonic()
        server.start()
        pid = server.proc.pid
        print(f"server pid {pid} healthy at {server.url} after {time.monotonic() - t0:.0f} s "
              f"(log {log_path})")
        loaded = proc_memory(pid)
        sampler = RssSampler(pid)
        sampler.start()
        t0 = time.monotonic()
        rows = workload(server.url, package, args.requests, args.concurrency, args.max_tokens,
                        args.request_timeout, args.deadline)
        print(f"workload: {args.requests} requests, {args.concurrency} at a time, "
              f"max_tokens {args.max_tokens}, {time.monotonic() - t0:.0f} s")
        for row in rows:
            if "error" in row:
                print(f"  #{row['index']}: error {row['error']}")
            else:
                print(f"  #{row['index']}: {'stream' if row['stream'] else 'plain ':<6} "
                      f"prompt {row['prompt_tokens']!s:>5} tok, completion "
                      f"{row['completion_tokens']!s:>3} tok, {row['seconds']:.1f} s")
        sampler.stop()
        if server.proc.poll() is not None:
            raise RuntimeError(f"flare serve exited with {server.proc.returncode} during the "
                               f"workload (log {log_path})")
        after = proc_memory(pid)
        print_table(report, loaded, after, max(sampler.peak, after["VmRSS"]))
        lines = memory_metrics(server.url)
        print("/metrics lines with 'bytes':" + ("" if lines else " none"))
        for line in lines:
            print(f"  {line}")
    finally:
        if sampler is not None:
            sampler.stop()
        print(f"server stopped (exit status {server.stop()})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
