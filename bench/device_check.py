"""Device check of Flare's CUDA path: parity, one served request, figures. Prints lines.

    python bench/device_check.py                 # on a CUDA machine (bench/device_check.sh)
    python bench/device_check.py --cpu-dry-run   # CPU only: the same steps where they apply

On CUDA it:
1. prepares a tiny random Llama (saved by transformers, the embedded tokenizer) and the
   embedded model (SmolLM2-135M) for `cuda` (float32), and prints each package's graph
   capture plan and decode attention timing;
2. checks greedy tokens on a few prompts: CUDA with graphs, CUDA without graphs, against
   the CPU torch path on the same weights (`PASS parity ...` / `FAIL parity ...` lines);
3. serves the tiny package once (`flare serve --device cuda` on 127.0.0.1) and answers one
   chat request over HTTP (`PASS serve ...` / `FAIL serve ...`);
4. checks exactness (batch and chunk invariance): a prompt's sampled fp32 logits, step
   by step, prefilled whole, in chunks of 7 and 64 tokens, and beside 3 other sequences,
   must be bit-identical, with graphs and without (`PASS invariance ...` / `FAIL
   invariance ...`; on the CPU dry run, which serves the torch reference path, a `NOTE`);
5. prints prefill tokens/s (one 512-token prompt) and decode tokens/s at batch 1 and 8,
   with and without graphs (`FIGURE ...` lines: figures, never pass/fail).

`--cpu-dry-run` runs the tiny model only, on CPU: packages for `cpu`, parity of the
static decode step (what a graph captures, run eagerly) against the eager path, a
served request on CPU, and the figures; the unit tests run it so this file cannot rot
unseen. Exit status: 0 when every PASS/FAIL line passed, 1 otherwise, 2 on a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("FLARE_FUSED_OPS", "0")  # CPU reference: the torch path, no build

import httpx  # noqa: E402
import torch  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Explain paged attention in one sentence:", "1, 2, 3, 4,"]
PARITY_TOKENS = 24
RESULTS: list[bool] = []


def say(kind: str, text: str, ok: bool | None = None) -> None:
    """Print one result line; `ok` records a PASS/FAIL."""
    if ok is not None:
        RESULTS.append(ok)
        kind = "PASS" if ok else "FAIL"
    print(f"{kind} {text}", flush=True)


def save_tiny_llama(folder: Path, tokenizer: Any, seed: int = 0) -> Path:
    """A random 2-layer Llama (GQA, 64 hidden) with the given tokenizer, saved as a
    Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=len(tokenizer), max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy_tokens(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from flare.runtime.request import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = engine.run_until_idle([GenerationRequest(str(i), p, params)
                                  for i, p in enumerate(prompts)])
    return [sum((o.token_ids for o in outs[str(i)]), []) for i in range(len(prompts))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def check_parity(label: str, ref: list[list[int]], got: list[list[int]]) -> None:
    for i, (r, g) in enumerate(zip(ref, got)):
        at = first_difference(r, g)
        say("", f"parity {label} prompt {i}: {len(g)} tokens"
            + ("" if at is None else f", first difference at token {at}: {r[at:at + 4]} "
               f"vs {g[at:at + 4]}"), ok=at is None)


def engines(pkg_path: Path, device: str) -> dict[str, Any]:
    """Engines over a package: "graphs" and "eager" on `device` (on CPU "graphs" runs the
    static step eagerly from a plan made here), and "cpu_ref" over the same weights on
    CPU (prefix cache off everywhere, so runs do not share state)."""
    from flare.package.reader import load_package
    from flare.runtime.cuda_graphs import GraphPlan, plan_buckets
    from flare.runtime.engine import Engine

    out: dict[str, Any] = {}
    pkg = load_package(pkg_path, device=device)
    plan = pkg.plan
    if device == "cpu":
        graphs = plan_buckets(plan.max_num_seqs, plan.pages_per_seq, plan.page_size)
        out["graphs"] = Engine.from_package(pkg, prefix_cache=False, decode_graphs=graphs)
    else:
        out["graphs"] = Engine.from_package(pkg, prefix_cache=False, cuda_graphs=True)
        if GraphPlan.from_manifest(pkg.manifest.graph_capture) is None:
            say("NOTE", f"{pkg_path.name}: graph capture disabled in the package: "
                f"{pkg.manifest.graph_capture}")
    out["eager"] = Engine.from_package(pkg, prefix_cache=False, cuda_graphs=False)
    if device == "cpu":
        out["cpu_ref"] = out["eager"]
    else:  # the same weights on the CPU (the package's plan, the torch path)
        tensors = {name: pkg.tensors[name].cpu() for name in pkg.tensors}
        out["cpu_ref"] = Engine(pkg.config, plan, tensors, pkg.tokenizer, "cpu",
                                prefix_cache=False)
    return out


def sampled_logits(engine: Any, prompts: dict[str, list[int]], n: int) -> dict[str, list]:
    """Greedy runs of `prompts` submitted together: each request's sampled fp32 logits
    rows, step by step (recorded by wrapping the engine's own `_sample`)."""
    from flare.runtime.request import GenerationRequest, SamplingParams

    got: dict[str, list] = {rid: [] for rid in prompts}
    sample = engine._sample

    def spy(sampling, logits):
        for row, seq in enumerate(sampling):
            got[seq.request.request_id].append(logits[row].detach().float().cpu().clone())
        return sample(sampling, logits)

    engine._sample = spy
    try:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        engine.run_until_idle([GenerationRequest(r, ids, params) for r, ids in prompts.items()])
    finally:
        engine._sample = sample
    return got


def check_invariance(name: str, pkg_path: Path, device: str, tokenizer: Any) -> None:
    """Exactness on `device`: one prompt's sampled logits whole, in chunks of 7 and 64,
    and beside 3 others, with graphs and without, must be bit-identical."""
    import dataclasses

    from flare.package.reader import load_package
    from flare.runtime.engine import Engine

    pkg = load_package(pkg_path, device=device)
    prompt = tokenizer.encode(PROMPTS[2] * 6)  # about 60 tokens
    others = {f"o{i}": tokenizer.encode(p) for i, p in enumerate(PROMPTS[:3])}
    ref = None
    for graphs in (False, True):
        for label, chunk, extra in (("whole", 512, {}), ("chunks of 7", 7, {}),
                                    ("chunks of 64", 64, {}), ("beside 3 others", 64, others)):
            plan = dataclasses.replace(pkg.plan, max_batch_tokens=max(chunk, 8))
            if graphs:  # the package's graph capture plan, on the CUDA device
                engine = Engine.from_package(dataclasses.replace(pkg, plan=plan),
                                             prefix_cache=False, cuda_graphs=True)
            else:
                engine = Engine(pkg.config, plan, pkg.tensors, pkg.tokenizer, device,
                                prefix_cache=False)
            got = sampled_logits(engine, {"x": prompt, **extra}, 8)["x"]
            if ref is None:
                ref = got
                continue
            same = len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
            diff = max((float((a - b).abs().max()) for a, b in zip(got, ref)), default=0.0)
            text = (f"invariance {name} {device}{'+graphs' if graphs else ''} {label}: "
                    f"{'bit-identical' if same else f'max abs diff {diff:.2e}'}")
            if device == "cpu":  # the dry run serves the torch reference path (SDPA, MKL)
                say("NOTE", text)
            else:
                say("", text, ok=same)
        if device == "cpu":
            break


def bench(engine: Any, label: str, vocab: int, max_seq_len: int, quick: bool = False) -> None:
    """FIGURE lines: prefill tokens/s of one prompt, decode tokens/s at batch 1 and 8
    (`quick`: 64-token prefill, 8 decode steps)."""
    from flare.runtime.request import GenerationRequest, SamplingParams

    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=gen).tolist()

    n_prefill = min(64 if quick else 512, max_seq_len - 2)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.run_until_idle([GenerationRequest("warm", ids(n_prefill), one)])  # warm-up
    t0 = time.perf_counter_ns()
    engine.run_until_idle([GenerationRequest("p", ids(n_prefill), one)])
    dt = (time.perf_counter_ns() - t0) / 1e9
    say("FIGURE", f"{label} prefill {n_prefill} tokens: {n_prefill / dt:,.0f} tok/s")
    new = min(9 if quick else 64, max_seq_len - 40)
    for batch in (1, 8):
        if batch > engine.plan.max_num_seqs:
            continue
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        for rep in ("warm", "run"):
            outs = engine.run_until_idle([GenerationRequest(f"{rep}{i}", ids(32), params)
                                          for i in range(batch)])
        firsts = [o[-1].timings.first_token_ns for o in outs.values()]
        ends = [o[-1].timings.finished_ns for o in outs.values()]
        dt = (max(ends) - max(firsts)) / 1e9
        say("FIGURE", f"{label} decode batch {batch}: {batch * (new - 1) / dt:,.0f} tok/s "
                      f"({new - 1} steps)")
    s = engine.stats()
    say("FIGURE", f"{label} steps: graph replays {s['decode_graph_replays_total']}, static "
                  f"eager {s['decode_static_eager_total']}, fallbacks "
                  f"{s['decode_graph_fallbacks_total']}, eager {s['eager_steps_total']}, "
                  f"graphs held {s['decode_graphs_captured']}")


def serve_once(pkg: Path, device: str, log_path: Path, timeout_s: float = 120) -> None:
    """`flare serve PKG --device DEVICE` on 127.0.0.1, one chat request, then SIGTERM."""
    from flare.serve_child import ServerStartError, free_port, stop_process, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "flare.cli", "serve", str(pkg), "--host", "127.0.0.1",
           "--port", str(port), "--device", device, "--no-prefix-cache"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        wait_healthy(proc, url, log_path, timeout_s)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]})
        answer = r.raise_for_status().json()
        n = answer["usage"]["completion_tokens"]
        state = httpx.get(f"{url}/debug/state", timeout=10).json()
        say("", f"serve {device}: chat answered with {n} tokens "
                f"({answer['choices'][0]['finish_reason']}); graph replays "
                f"{state.get('decode_graph_replays_total')}, graphs held "
                f"{state.get('decode_graphs_captured')}", ok=n > 0)
    except Exception as exc:
        tail = "" if isinstance(exc, ServerStartError) or not log_path.exists() \
            else "\n" + log_path.read_text(errors="replace")[-2000:]
        say("", f"serve {device}: {exc}{tail}", ok=False)
    finally:
        stop_process(proc, ((signal.SIGTERM, 30.0),))


def check_model(name: str, pkg: Path, device: str, tokenizer: Any,
                quick: bool = False) -> None:
    from flare.package.contract import read_manifest

    m = read_manifest(pkg)
    say("INFO", f"{name}: device class {m.device_class}, graph_capture "
                f"{json.dumps(m.graph_capture)}")
    if "decode_attention" in m.tuning:
        say("INFO", f"{name}: decode attention {json.dumps(m.tuning['decode_attention'])}")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    es = engines(pkg, device)
    ref = greedy_tokens(es["cpu_ref"], prompts, PARITY_TOKENS)
    where = "cpu" if device == "cpu" else "cuda"
    check_parity(f"{name} {where}+graphs vs cpu", ref,
                 greedy_tokens(es["graphs"], prompts, PARITY_TOKENS))
    check_parity(f"{name} {where} eager vs cpu", ref,
                 greedy_tokens(es["eager"], prompts, PARITY_TOKENS))
    for key in ("graphs", "eager"):
        es[key].check_integrity()
    check_invariance(name, pkg, device, tokenizer)
    vocab = es["eager"].config.vocab_size
    for key in ("graphs", "eager"):
        bench(es[key], f"{name} {where} {key}", vocab, es[key].plan.max_seq_len, quick)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="CPU only, tiny model only (what the unit tests run)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: temp)")
    ap.add_argument("--no-serve", action="store_true", help="skip the served request")
    ap.add_argument("--no-embedded", action="store_true", help="tiny model only")
    ap.add_argument("--quick", action="store_true", help="short figures (tests)")
    args = ap.parse_args(argv)
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        say("", "torch.cuda.is_available() is False: no CUDA device or a CPU-only torch "
                f"({torch.__version__}); use --cpu-dry-run", ok=False)
        return 1
    say("INFO", f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if device == "cuda" else ""))
    from flare.loading.checkpoint import load_checkpoint
    from flare.loading.embedded import embedded_model_path
    from flare.prepare.package import prepare_package, write_package

    work = args.work or Path(tempfile.mkdtemp(prefix="flare-device-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    embedded = load_checkpoint(embedded_model_path(), dtype=torch.float32, progress=False)
    tiny_dir = save_tiny_llama(work / "tiny-llama", embedded.tokenizer)
    tiny_pkg = work / f"tiny-{device}"
    prepare_package(tiny_dir, tiny_pkg, max_seq_len=1024, max_num_seqs=8,
                    device=device, progress=False)
    check_model("tiny", tiny_pkg, device, embedded.tokenizer, args.quick)
    if not args.no_serve:
        serve_once(tiny_pkg, device, work / "serve.log")
    if not args.cpu_dry_run and not args.no_embedded:
        emb_pkg = work / "smollm2-cuda"
        write_package(embedded, emb_pkg, max_seq_len=2048, max_num_seqs=8, device=device,
                      progress=False)
        check_model("smollm2", emb_pkg, device, embedded.tokenizer, args.quick)
    ok = all(RESULTS)
    say("DONE", f"{sum(RESULTS)}/{len(RESULTS)} checks passed in "
                f"{time.monotonic() - t0:.0f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        print("FAIL device check crashed (traceback above)", flush=True)
        sys.exit(2)
