"""`flare evidence verify PACKET [--metric M] [--group G] [--min-samples N] [--max-ms X]
[--package PKG] [--corpus FILE] [--out RECEIPT]`.

Exit status: 0 PASS, 1 FAIL, 2 INCONCLUSIVE, 3 usage error (bad flag, no such folder,
receipt path inside the packet).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flare.cliutil import OneLineParser, positive_int, positive_number
from flare.evidence import recompute

EXIT_USAGE = 3  # 0 PASS, 1 FAIL, 2 INCONCLUSIVE (flare.evidence.receipt.EXIT_CODES)

EPILOG = """\
exit status:
  0  PASS          every check passed and every threshold given is met
  1  FAIL          the evidence is intact and shows a violation or a missed threshold
  2  INCONCLUSIVE  evidence is missing or inconsistent: nothing can be concluded
  3  usage error   bad arguments, PACKET is not a folder, --out inside the packet

The packet is only read (its files are byte-identical afterwards). The receipt (JSON) goes
to --out, or to stdout; a one-line verdict goes to stderr. See docs/evidence.md.
"""


class _Parser(OneLineParser):
    """Usage errors exit with status 3, unknown arguments included (the parent `flare`
    parser would report those with its own status 2, which means INCONCLUSIVE here)."""

    exit_status = EXIT_USAGE

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def _add_verify(sub: Any) -> None:
    v = sub.add_parser("verify", help="verify a packet and write a receipt",
                       description="Verify a qualification packet offline: recompute the "
                       "metric from raw observations, run the named checks, write a receipt.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("packet", type=Path, help="the packet folder (written by flare qualify)")
    v.add_argument("--metric", choices=sorted(recompute.SELECTABLE),
                   default=recompute.DEFAULT_METRIC,
                   help=f"metric to recompute (default {recompute.DEFAULT_METRIC}: median "
                        f"client-clock delivery TTFT, ns)")
    v.add_argument("--group", default=recompute.DEFAULT_GROUP,
                   help=f"observation group the metric is computed over (default "
                        f"{recompute.DEFAULT_GROUP})")
    v.add_argument("--min-samples", type=positive_int, default=5,
                   help="fewest samples of the metric in the group (default 5)")
    v.add_argument("--max-ms", "--max-ttft-ms", dest="max_ms", type=positive_number,
                   default=None, help="threshold: the metric must be at most this many ms")
    v.add_argument("--package", type=Path, default=None,
                   help="also check the packet names this package (package_id, manifest)")
    v.add_argument("--corpus", type=Path, default=None,
                   help="also check the packet names this corpus file (sha256)")
    v.add_argument("--out", type=Path, default=None,
                   help="write the receipt here (default: stdout); never inside the packet")


def add_evidence_parser(sub: Any) -> argparse.ArgumentParser:
    """Add `evidence` (with its action `verify`) to the subcommands `sub` of `flare`."""
    ev = sub.add_parser("evidence", help="verify qualification packets offline",
                        description="Offline checks of qualification packets.", epilog=EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    # the actions' parsers exit with status 3 on a usage error (2 means INCONCLUSIVE)
    actions = ev.add_subparsers(dest="evidence_action", parser_class=_Parser)
    _add_verify(actions)
    return ev


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (`python -m flare.evidence.cli verify ...`)."""
    parser = _Parser(prog="flare")
    add_evidence_parser(parser.add_subparsers(dest="command", required=True,
                                              parser_class=_Parser))
    return parser


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """`flare evidence ...` after parsing. Returns the exit status."""
    if args.evidence_action is None:
        print("flare evidence: error: expected an action: verify", file=sys.stderr)
        return EXIT_USAGE
    from flare.evidence.checks import Options
    from flare.evidence.receipt import verify

    if not args.packet.is_dir():
        print(f"flare evidence verify: error: {args.packet} is not a folder", file=sys.stderr)
        return EXIT_USAGE
    if args.out is not None and _inside(args.out, args.packet):
        print(f"flare evidence verify: error: --out {args.out} is inside the packet; the "
              f"verifier never writes into a packet", file=sys.stderr)
        return EXIT_USAGE
    opts = Options(metric=args.metric, group=args.group, min_samples=args.min_samples,
                   max_ms=args.max_ms, package=args.package, corpus=args.corpus)
    receipt = verify(args.packet, opts)
    text = json.dumps(receipt, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    metric = receipt["metric"]
    shown = (f"{metric['name']} over {metric['group']} = {metric['value'] / 1e6:.3f} ms "
             f"({metric['n_samples']} samples)"
             if metric and metric["value"] is not None else "metric: no value")
    failing = ", ".join(receipt["failing_checks"]) or "none"
    print(f"{receipt['verdict']}: {shown}; failing checks: {failing}", file=sys.stderr)
    return receipt["exit_code"]


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
