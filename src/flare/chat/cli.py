"""`flare chat`: its options and what it starts.

    flare chat [--url URL] [--api-key KEY]      a running server (default
                                                http://127.0.0.1:8000, what make serve runs)
    flare chat --embedded [--cache-dir DIR]     starts `flare serve --embedded` as a child
    flare chat PKG                              starts `flare serve PKG` as a child
    common: [--session NAME] [--system TEXT] [--model ID] [--max-tokens N]
            [--temperature T] [--ignore-eos] [--plain] [--no-save] [--history-dir DIR]

A child server listens on a free port of 127.0.0.1, logs to HISTORY_DIR/serve.log, keeps
conversation states in `--state-dir` (default CACHE_DIR/chat-state, so a later `flare
chat` resumes from its disk tier) and is stopped when the chat ends. Without `--session`
the conversation used last with this model continues (or `chat-1` starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from flare.cache_dir import default_cache_dir
from flare.cliutil import non_negative_int, positive_int

DEFAULT_URL = "http://127.0.0.1:8000"
EMBEDDED_PAGES = 1024  # as `make serve`: the package it prepares is reused


def add_chat_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `flare chat` on the `flare` subcommands."""
    p = sub.add_parser("chat", help="chat in the terminal with a served model",
                       description="Interactive chat in the terminal: streamed Markdown "
                       "answers in a named Flare session (kept, forked, saved to the disk "
                       "tier, resumed after a restart).")
    p.add_argument("package", nargs="?", type=Path,
                   help="a package folder: start `flare serve PKG` for this chat")
    target = p.add_argument_group("server")
    target.add_argument("--url", default=None,
                        help=f"a running Flare server (default {DEFAULT_URL} when neither "
                             f"PKG nor --embedded is given)")
    target.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default $FLARE_API_KEY)")
    target.add_argument("--embedded", action="store_true",
                        help="start `flare serve --embedded` (the embedded SmolLM2) for "
                             "this chat")
    target.add_argument("--cache-dir", type=Path, default=None,
                        help="--embedded: where its package is kept (default: "
                             "$FLARE_CACHE_DIR or ~/.cache/flare; make serve uses "
                             ".cache/flare)")
    target.add_argument("--num-pages", type=positive_int, default=None,
                        help=f"--embedded: KV pages of its package (default {EMBEDDED_PAGES}, "
                             f"as make serve)")
    target.add_argument("--state-dir", type=Path, default=None,
                        help="a started server's disk tier folder (default "
                             "CACHE_DIR/chat-state)")
    conv = p.add_argument_group("conversation")
    conv.add_argument("--session", default=None, metavar="NAME",
                      help="the conversation (and server session) to continue or start "
                           "(default: the one used last with this model)")
    conv.add_argument("--system", default=None, metavar="TEXT",
                      help="system prompt of a new conversation")
    conv.add_argument("--model", default=None,
                      help="model id requests name (default: the first the server lists)")
    conv.add_argument("--max-tokens", type=positive_int, default=None,
                      help="most tokens of one answer (default: the room left)")
    conv.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature, 0 = greedy (default: the server's)")
    conv.add_argument("--ignore-eos", action="store_true",
                      help="keep generating past end-of-sequence until --max-tokens "
                           "(for timing)")
    conv.add_argument("--plain", action="store_true",
                      help="print answers as plain text as they arrive (no Markdown)")
    conv.add_argument("--no-save", action="store_true",
                      help="do not save the answered sessions to the disk tier on exit")
    conv.add_argument("--history-dir", type=Path, default=None,
                      help="where conversations and input history are kept (default "
                           "CACHE_DIR/chat)")
    conv.add_argument("--startup-timeout", type=non_negative_int, default=900,
                      metavar="SECONDS", help="wait this long for a started server "
                                              "(default 900: --embedded may prepare first)")
    return p


def _serve_args(args: argparse.Namespace, cache: Path) -> list[str]:
    """What follows `flare serve` for the child."""
    state = args.state_dir or cache / "chat-state"
    if args.embedded:
        out = ["--embedded", "--cache-dir", str(cache),
               "--num-pages", str(args.num_pages or EMBEDDED_PAGES)]
    else:
        if args.num_pages is not None:
            raise ValueError("--num-pages belongs to --embedded (PKG keeps its own plan)")
        out = [str(args.package)]
    return out + ["--state-dir", str(state)]


def run(args: argparse.Namespace) -> int:
    """`flare chat`. Returns the exit status (0; 1 when no server could be had).

    Raises:
        ValueError: conflicting options (the caller prints one line, status 2).
    """
    from rich.console import Console

    from flare.chat.client import ChatError, FlareClient
    from flare.chat.repl import ChatApp, ChatOptions
    from flare.chat.store import Conversation, ConversationStore, StoreError, check_name
    from flare.serve_child import ChildServer, ServerStartError

    starts = (args.package is not None) + bool(args.embedded)
    if starts > 1 or (starts and args.url):
        raise ValueError("give one of PKG, --embedded or --url")
    if args.state_dir is not None and not starts:
        raise ValueError("--state-dir is for a server flare chat starts (PKG or --embedded); "
                         "a running server has its own")
    if args.session is not None:
        try:
            check_name(args.session)
        except StoreError as exc:
            raise ValueError(f"--session: {exc}") from None
    cache = args.cache_dir or default_cache_dir()
    history_dir = args.history_dir or default_cache_dir() / "chat"
    console = Console(stderr=False)
    err = Console(stderr=True)
    child = None
    if starts:
        what = "--embedded" if args.embedded else str(args.package)
        child = ChildServer(_serve_args(args, cache), history_dir / "serve.log")
        try:
            with err.status(f"starting flare serve {what} on {child.url} "
                            f"(log: {child.log_path})"):
                child.wait_ready(args.startup_timeout)
        except ServerStartError as exc:
            err.print(f"flare chat: {exc}", markup=False, highlight=False)
            return 1
        except KeyboardInterrupt:
            child.stop()
            return 130
        url = child.url
    else:
        url = args.url or DEFAULT_URL
    client = FlareClient(url, api_key=args.api_key)
    try:
        try:
            models = client.models()
        except ChatError as exc:
            hint = ("" if args.url or starts else
                    "; start one with `make serve`, or run `flare chat --embedded` or "
                    "`flare chat PKG`")
            err.print(f"flare chat: {exc}{hint}", markup=False, highlight=False)
            return 1
        model = args.model or (models[0] if models else None)
        if model is None:
            err.print(f"flare chat: {url} serves no model", markup=False)
            return 1
        store = ConversationStore(history_dir, model)
        name = args.session or store.last() or store.new_name()
        resumed = store.exists(name)
        if resumed:
            try:
                conv = store.load(name)
            except StoreError as exc:
                err.print(f"flare chat: {exc}", markup=False, highlight=False)
                return 1
            if args.system is not None:
                conv.system = args.system
        else:
            conv = Conversation(name=name, system=args.system)
        options = ChatOptions(max_tokens=args.max_tokens, temperature=args.temperature,
                              ignore_eos=args.ignore_eos, markdown=not args.plain,
                              save_on_exit=not args.no_save)
        if not sys.stdin.isatty():
            return _one_shot(client, model, store, conv, options, console)
        history_dir.mkdir(parents=True, exist_ok=True)
        app = ChatApp(client, model, store, conv, options, console,
                      history_file=history_dir / "input-history")
        return app.run(resumed)
    finally:
        client.close()
        if child is not None:
            with err.status("stopping flare serve"):
                child.stop()


def _one_shot(client, model, store, conv, options, console) -> int:
    """stdin is not a terminal: its whole text is one message; print the answer, leave."""
    from flare.chat.repl import ChatApp

    text = sys.stdin.read().strip()
    if not text:
        return 0
    app = ChatApp(client, model, store, conv, dataclasses.replace(options, markdown=False),
                  console)
    app.turn(text)
    app.leave()
    return 0
