"""`qualify()`: start (or reach) a server, run the scenarios, write the packet."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from flare.evidence.schema import EVIDENCE_FILES
from flare.qualify import provenance
from flare.qualify.client import Client
from flare.qualify.packet import build_packet, write_packet
from flare.qualify.scenarios import Run
from flare.qualify.server import ManagedServer
from flare.qualify.workload import Settings
from flare.serve_child import ServerStartError

DEFAULT_CORPUS = Path(__file__).resolve().parents[3] / "corpus" / "agent-sessions-v1.json"
SERVER_LOG = "server.log"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def load_corpus(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(corpus, its identity {name, sha256, sessions}). The sha256 is over the file's bytes."""
    data = Path(path).read_bytes()
    corpus = json.loads(data)
    for s in corpus["sessions"]:
        if not s["messages"] or s["messages"][-1]["role"] != "user":
            raise ValueError(f"corpus {path}: session {s.get('id')!r} must end with a user "
                             f"message")
    name = f"{corpus['name']}-v{corpus['version']}"
    return corpus, {"name": name, "sha256": provenance.sha256_bytes(data),
                    "sessions": len(corpus["sessions"])}


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return count


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse to mix two runs in one folder: an existing packet needs `overwrite`."""
    out = Path(out)
    existing = [n for n in EVIDENCE_FILES if (out / n).exists()]
    if existing and not overwrite:
        raise ValueError(f"{out} already holds a packet ({', '.join(existing)}); choose "
                         f"another folder or pass --overwrite")
    for n in existing:
        (out / n).unlink()
    out.mkdir(parents=True, exist_ok=True)


def qualify(out: Path, *, url: str | None = None, package: Path | None = None,
            settings: Settings | None = None, corpus_path: Path | None = DEFAULT_CORPUS,
            startup_timeout: float = 180.0, request_timeout: float = 300.0,
            overwrite: bool = False, argv: list[str] | None = None,
            log: Callable[[str], None] | None = None, state_dir: Path | None = None) -> Path:
    """Run a qualification and write its packet into `out`.

    With `package` and no `url`, `flare serve PACKAGE` is started on a free 127.0.0.1 port
    and stopped afterwards (its log is `out/server.log`), with `--state-dir state_dir` (its
    disk tier, kept across the restart of `restart-restore`; default a fresh temporary
    folder, deleted afterwards). With `url`, that server is used; `package` then only
    supplies identity, plan, memory report and tokenizer, and `restart-restore` is skipped.

    Returns:
        `out`.

    Raises:
        ValueError: neither url nor package, or `out` holds a packet already.
        ServerStartError: the server did not start.
    """
    if url is None and package is None:
        raise ValueError("qualify needs --url or --package")
    settings = settings or Settings()
    log = log or (lambda s: print(f"[flare qualify] {s}", file=sys.stderr))
    out = Path(out)
    prepare_out(out, overwrite)
    pkg_info = provenance.package_info(package) if package is not None else None
    corpus = corpus_id = None
    if corpus_path is not None:
        corpus, corpus_id = load_corpus(corpus_path)
    started_at = _now()
    t_start = time.monotonic()
    server = None
    with contextlib.ExitStack() as stack:
        if url is None:
            folder = state_dir
            if folder is None:  # fresh: the restart restores this run's states only
                folder = Path(tempfile.mkdtemp(prefix="flare-qualify-state-"))
                stack.callback(shutil.rmtree, folder, ignore_errors=True)  # after stop
            server = ManagedServer(package, out / SERVER_LOG, startup_timeout,
                                   state_dir=folder)
            server.launch()
            stack.callback(server.stop)
        tokenizer = None
        if package is not None:  # loads while the server starts
            from flare.loading.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(package)
        if server is not None:
            server.wait_ready()
        base_url, started = (server.url, True) if server is not None else (url, False)
        probe = Client(base_url, model="", timeout=request_timeout)
        try:
            models = probe.get_json("/v1/models")
        except (httpx.HTTPError, ValueError) as exc:
            raise ServerStartError(f"{base_url}: GET /v1/models failed: {exc}") from None
        finally:
            probe.close()
        card = (models.get("data") or [{}])[0]
        model = card.get("id") or (pkg_info["identity"]["model_name"] if pkg_info else "")
        client = Client(base_url, model, _token_counter(tokenizer) if tokenizer else None,
                        timeout=request_timeout)
        log(f"server {base_url} model {model!r} ({'started here' if started else 'given'}); "
            f"ready after {time.monotonic() - t_start:.1f} s")
        run = Run(client, settings, tokenizer, corpus, log,
                  restart=server.restart if server is not None else None)
        try:
            run.run_all()
        finally:
            client.close()
    ended_at = _now()
    packet = build_packet(
        observations=run.observations,
        scenarios=[s.to_dict() for s in run.scenarios],
        snapshots=run.snapshots,
        settings={**asdict(settings),
                  "token_count_method": "tokenizer" if tokenizer is not None else "none",
                  "request_timeout_s": request_timeout,
                  # the started server's --state-dir: given, or "temporary" (fresh, deleted)
                  "state_dir": (None if server is None else
                                str(state_dir) if state_dir is not None else "temporary")},
        package=pkg_info,
        corpus=corpus_id,
        server={"url": base_url, "started_by_harness": started, "exclusive": started,
                "model": model, "system_fingerprint": client.fingerprint},
        server_max_model_len=card.get("max_model_len"),
        git=provenance.git_revision(),
        machine=provenance.machine(),
        started_at=started_at,
        ended_at=ended_at,
        argv=argv,
    )
    write_packet(out, packet, run.observations)
    log(f"packet written to {out} ({len(run.observations)} observations)")
    return out
