"""A local Flare cluster: one redis-server, N `flare serve` replicas of one package sharing
conversation states through it (--remote-tier), and SGLang's gateway `smg` in front (its
HTTP worker mode, which lists the replicas' model on its /v1/models; docs/scale-out.md).

    python scripts/cluster.py up   [--run-dir .cluster] [--replicas 2] [--policy cache_aware]
                                   [--package PKG | (the embedded model)] [--api-key KEY]
    python scripts/cluster.py down [--run-dir .cluster]
    (`make cluster` / `make cluster-down` run these.)

Everything binds 127.0.0.1 on free ports. The run folder holds each process's log,
redis-server's data folder, and `cluster.json` (pids, URLs) that `down` reads. `up` installs
the distribution's redis-server with apt-get when it is missing (as root, or through sudo).
Across machines, see docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

VENV_BIN = Path(sys.executable).parent
STATE = "cluster.json"
START_TIMEOUT_S = 180  # a replica loads and hashes the package; a busy machine is slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find(name: str) -> str | None:
    local = VENV_BIN / name
    return str(local) if local.is_file() else shutil.which(name)


def ensure_redis() -> str:
    """The redis-server executable; installs Debian's package with apt-get if missing.

    Raises:
        SystemExit: it is missing and cannot be installed here.
    """
    exe = find("redis-server")
    if exe:
        return exe
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None or not shutil.which("apt-get"):
        sys.exit("redis-server is missing and apt-get is not usable here: install the "
                 "distribution's redis-server package")
    print("installing redis-server with apt-get ...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run([*sudo, "apt-get", "update", "-q"], check=True, env=env)
    subprocess.run([*sudo, "apt-get", "install", "-y", "-q", "redis-server"], check=True,
                   env=env)
    exe = find("redis-server")
    if not exe:
        sys.exit("apt-get installed redis-server but it is not on PATH")
    return exe


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    """Start a process in its own session (it outlives this script), output to `log`."""
    with open(log, "ab") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path, headers: dict | None = None,
              timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {proc.returncode}:\n"
                               + log.read_text(errors="replace")[-3000:])
        try:
            if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: no 200 within {timeout:.0f} s:\n"
                               + log.read_text(errors="replace")[-3000:])
        time.sleep(0.3)


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"port {port} did not open") from None
            time.sleep(0.05)


def prepare_embedded(cache_dir: Path) -> Path:
    """The embedded model's package in `cache_dir` (prepared once, reused after)."""
    from flare.loading.embedded import embedded_model_path
    from flare.prepare.package import ensure_package

    return Path(ensure_package(embedded_model_path(), cache_dir, progress=True))


def up(args: argparse.Namespace) -> int:
    run = Path(args.run_dir).resolve()
    if (run / STATE).exists():
        sys.exit(f"a cluster is already up ({run / STATE}); run `make cluster-down` first")
    run.mkdir(parents=True, exist_ok=True)
    smg = find("smg")
    if smg is None:
        sys.exit("smg (SGLang's model gateway) is missing: pip install smg")
    redis_exe = ensure_redis()
    package = Path(args.package) if args.package else prepare_embedded(Path(args.cache_dir))
    state: dict = {"run_dir": str(run), "pids": {}}
    procs: list[subprocess.Popen] = []

    def record(name: str, proc: subprocess.Popen) -> None:
        procs.append(proc)
        state["pids"][name] = proc.pid
        (run / STATE).write_text(json.dumps(state, indent=2))

    try:
        rport = free_port()
        (run / "redis").mkdir(exist_ok=True)
        redis_args = [redis_exe, "--bind", "127.0.0.1", "--port", str(rport), "--dir",
                      str(run / "redis"), "--save", "", "--appendonly", "no"]
        if args.redis_password:
            redis_args += ["--requirepass", args.redis_password]
        proc = spawn(redis_args, run / "redis.log")
        record("redis", proc)
        wait_port(rport, proc)
        state["redis_url"] = f"redis://127.0.0.1:{rport}/0"
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
        env = dict(os.environ)
        if args.redis_password:
            env["FLARE_REMOTE_TIER_PASSWORD"] = args.redis_password  # not on the command line
        if args.api_key:
            env["FLARE_API_KEY"] = args.api_key
        urls = []
        for i in range(args.replicas):
            port = free_port()
            log = run / f"replica-{i}.log"
            with open(log, "ab") as f:
                proc = subprocess.Popen(
                    [str(VENV_BIN / "flare"), "serve", str(package), "--host", "127.0.0.1",
                     "--port", str(port), "--remote-tier", state["redis_url"],
                     "--remote-tier-mib", str(args.remote_tier_mib), *args.serve_arg],
                    stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, env=env)
            record(f"replica-{i}", proc)
            urls.append(f"http://127.0.0.1:{port}")
            wait_http(urls[-1] + "/health", proc, log)
            print(f"replica {i}: {urls[-1]}", flush=True)
        state["replica_urls"] = urls
        gport, mport = free_port(), free_port()
        # smg binds its Prometheus exporter on 0.0.0.0:29000 unless told: loopback, free port
        gw = [smg, "launch", "--host", "127.0.0.1", "--port", str(gport),
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport),
              "--policy", args.policy, "--worker-urls", *urls,
              "--health-check-endpoint", "/health", "--health-check-interval-secs", "5"]
        if args.api_key:  # smg discovers the workers' model with it (callers send theirs)
            gw += ["--api-key", args.api_key]
        proc = spawn(gw, run / "gateway.log")
        record("gateway", proc)
        state["gateway_url"] = f"http://127.0.0.1:{gport}"
        (run / STATE).write_text(json.dumps(state, indent=2))
        # its /v1/models answers 200 once a replica is discovered and healthy
        wait_http(state["gateway_url"] + "/v1/models", proc, run / "gateway.log", headers)
    except BaseException:
        down(args)
        raise
    print(f"gateway: {state['gateway_url']}  (OpenAI-compatible; `make cluster-down` stops "
          f"it all; logs and pids in {run})")
    return 0


def down(args: argparse.Namespace) -> int:
    path = Path(args.run_dir).resolve() / STATE
    if not path.exists():
        print("no cluster is up")
        return 0
    pids = json.loads(path.read_text())["pids"]
    order = [n for n in ("gateway",) if n in pids] + sorted(
        n for n in pids if n.startswith("replica")) + [n for n in ("redis",) if n in pids]
    for name in order:
        _stop(pids[name], name)
    path.unlink()
    print("cluster stopped")
    return 0


def _stop(pid: int, name: str, timeout: float = 20) -> None:
    """SIGTERM the process (its own session's leader), SIGKILL after `timeout`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        except ChildProcessError:  # not our child: poll for its exit
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.1)
    print(f"{name} ({pid}) did not stop: SIGKILL")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("up", "down"):
        s = sub.add_parser(name)
        s.add_argument("--run-dir", default=".cluster", help="pids, logs (default .cluster)")
    u = sub.choices["up"]
    u.add_argument("--package", default=None, help="package folder (default: the embedded "
                                                    "model, prepared in --cache-dir)")
    u.add_argument("--cache-dir", default=".cache/flare")
    u.add_argument("--replicas", type=int, default=2)
    u.add_argument("--policy", default="cache_aware",
                   help="smg routing policy (default cache_aware; docs/scale-out.md)")
    u.add_argument("--api-key", default=os.environ.get("FLARE_API_KEY"),
                   help="required by the replicas and sent by the gateway to them")
    u.add_argument("--redis-password", default=os.environ.get("FLARE_REMOTE_TIER_PASSWORD"))
    u.add_argument("--remote-tier-mib", type=int, default=1024)
    u.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for every `flare serve` (repeat)")
    args = p.parse_args(argv)
    return up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    sys.exit(main())
