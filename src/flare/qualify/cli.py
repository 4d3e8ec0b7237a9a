"""`flare qualify` and `flare qualify report`.

    flare qualify --package PKG --out DIR [--quick] [...]   start `flare serve PKG`, run, stop
    flare qualify --url URL [--package PKG] --out DIR [...] use a running server
    flare qualify report DIR [--report-out FOLDER]          HTML + PNG plots, table on stdout

Exit status: 0 packet (or report) written; 1 the run could not happen (server did not
start, packet refused); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from flare.cliutil import positive_int

EPILOG = """\
The packet (packet.json, observations.jsonl, summary.json) is what `flare evidence verify`
checks. Every request sent is one observation, failed and cancelled ones included.
restart-restore restarts the server the harness started (skipped with --url).
See docs/qualification.md.
"""


def add_qualify_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `qualify` to the subcommands `sub` of `flare`."""
    q = sub.add_parser("qualify", help="measure a server and write a qualification packet",
                       description="Run multi-turn workloads against a server over HTTP/SSE "
                       "and write a qualification packet; `flare qualify report DIR` renders "
                       "one.", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("action", nargs="?", default=None, metavar="report",
                   help="`report`: write the HTML report of the packet DIR")
    q.add_argument("dir", nargs="?", type=Path, default=None, metavar="DIR",
                   help="with `report`: the packet folder")
    src = q.add_argument_group("server")
    src.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    src.add_argument("--package", type=Path, default=None,
                     help="runtime package: started with `flare serve` on a free 127.0.0.1 "
                          "port unless --url is given; gives identity, plan, memory report "
                          "and tokenizer")
    src.add_argument("--startup-timeout", type=float, default=180.0,
                     help="seconds to wait for the started server (default 180)")
    src.add_argument("--request-timeout", type=float, default=300.0,
                     help="seconds between reads of one response (default 300)")
    run = q.add_argument_group("run")
    run.add_argument("--out", type=Path, default=None, help="packet folder to write")
    run.add_argument("--overwrite", action="store_true",
                     help="replace a packet already in --out")
    run.add_argument("--quick", action="store_true",
                     help="a short run (5 ttft-512 samples, 4 tokens per request, one agent "
                          "session of 3 turns, one host-restore and one restart-restore "
                          "conversation of 2 turns)")
    run.add_argument("--max-tokens", type=positive_int, default=None,
                     help="completion tokens per request (default 32; quick 4)")
    run.add_argument("--ttft-samples", type=positive_int, default=None,
                     help="requests in ttft-512 (default 20; quick 5)")
    run.add_argument("--sessions", type=positive_int, default=None,
                     help="agent sessions to replay (default all; quick 1)")
    run.add_argument("--max-turns", type=positive_int, default=None,
                     help="turns per agent session (default all; quick 3)")
    run.add_argument("--no-cold", action="store_true",
                     help="skip agent-session-cold (the no-reuse baseline)")
    run.add_argument("--no-restart", action="store_true",
                     help="skip restart-restore (it restarts the started server once)")
    run.add_argument("--state-dir", type=Path, default=None,
                     help="--state-dir of the started server (its disk tier; default a fresh "
                          "temporary folder, deleted after the run)")
    run.add_argument("--corpus", type=Path, default=None,
                     help="agent-session corpus (default corpus/agent-sessions-v1.json)")
    rep = q.add_argument_group("report")
    rep.add_argument("--report-out", type=Path, default=None,
                     help="report folder (default DIR/report)")
    return q


def run(args: argparse.Namespace) -> int:
    """`flare qualify ...` after parsing. Returns the exit status."""
    if args.action is not None:
        if args.action != "report":
            raise ValueError(f"unknown action {args.action!r}; expected `report DIR` or run "
                             f"options (--url/--package --out)")
        if args.dir is None:
            raise ValueError("qualify report needs the packet folder DIR")
        from flare.qualify.report import write_report

        index, table = write_report(args.dir, args.report_out)
        print(table)
        print(f"report: {index}", file=sys.stderr)
        return 0
    if args.out is None:
        raise ValueError("qualify needs --out DIR (and --url or --package)")
    if args.url is None and args.package is None:
        raise ValueError("qualify needs --url URL or --package PKG")
    from flare.qualify.runner import DEFAULT_CORPUS, qualify
    from flare.qualify.workload import Settings
    from flare.serve_child import ServerStartError

    overrides = {k: v for k, v in (("max_tokens", args.max_tokens),
                                   ("ttft_samples", args.ttft_samples),
                                   ("sessions", args.sessions), ("max_turns", args.max_turns))
                 if v is not None}
    if args.no_cold:
        overrides["cold"] = False
    if args.no_restart:
        overrides["restart_restore"] = 0
    settings = Settings.quick(**overrides) if args.quick else Settings(**overrides)
    try:
        out = qualify(args.out, url=args.url, package=args.package, settings=settings,
                      corpus_path=args.corpus or DEFAULT_CORPUS,
                      startup_timeout=args.startup_timeout,
                      request_timeout=args.request_timeout, overwrite=args.overwrite,
                      argv=None, state_dir=args.state_dir)
    except ServerStartError as exc:
        print(f"flare qualify: error: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0
