"""Engine figures for the embedded model on this machine, beside transformers on the same weights.

Prints prefill tokens/s at 512 and 2,048 prompt tokens, decode tokens/s at batch 1 and
aggregate decode tokens/s at batch 8, for Flare's engine and for transformers' `generate`,
plus peak RSS. Figures, not pass/fail: compare the two columns of one run, never against
numbers from another machine.

    .venv/bin/python bench/bench_engine.py [--model PATH] [--decode-tokens 128]
        [--weights fp16|full|q4|q4x8] [--threads N] [--skip-transformers]

Flare runs the weight format a default CPU package stores (`--weights`, see
flare.models.quant) with the prefix cache off; transformers runs the fp32 weights.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from flare.loading.checkpoint import load_checkpoint
from flare.loading.embedded import embedded_model_path
from flare.models.quant.formats import default_kv_dtype
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.boot import freeze_startup_objects
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams


def _prompt(tokenizer, n: int) -> list[int]:
    words = "The quick brown fox jumps over the lazy dog while the engine keeps counting. "
    ids = tokenizer.encode(words * (n // 8 + 8), add_special_tokens=False)
    return ids[:n]


def _run(engine: Engine, reqs: list[GenerationRequest]) -> tuple[float, dict[str, list[int]]]:
    """Run requests to completion; returns (start ns, first-token / done ns and counts)."""
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    counts: dict[str, int] = {}

    def on_output(out):
        if out.token_ids and out.request_id not in first:
            first[out.request_id] = time.perf_counter_ns()
        counts[out.request_id] = out.num_completion_tokens
        if out.finished:
            done[out.request_id] = time.perf_counter_ns()

    engine.on_output = on_output
    t0 = time.perf_counter_ns()
    engine.run_until_idle(reqs)
    return t0, {"first": first, "done": done, "counts": counts}


def flare_engine(ckpt, weights: str, *, max_seq_len: int = 4096, max_num_seqs: int = 8,
                 max_batch_tokens: int = 512, prefix_cache: bool = False,
                 stored: dict[str, torch.Tensor] | None = None,
                 num_pages: int | None = None) -> Engine:
    """Flare's engine on the checkpoint's weights in format `weights` ("fp16", "full",
    "q4", "q4x8", "kx8", ...), prefix cache off by default (every prompt is computed in
    full). `stored`: the tensors already in that format (`convert_tensors`' output; the
    engine only reads them, so two engines may share them), else converted here as
    `flare prepare` does, from a GGUF's own blocks where the format holds them.
    `num_pages`: the KV pool's pages (default: `max_num_seqs` full-length sequences).
    The pool's dtype is the format's default, as `flare prepare` gives it (float16 for the
    int8 formats: `default_kv_dtype`). Its start-up objects are frozen out of the cyclic
    collector, as `flare serve` freezes them (`freeze_startup_objects`), so no full
    collection walks the weights' wrappers in the middle of a timed phase."""
    plan = make_plan(ckpt.config, max_seq_len=max_seq_len, max_num_seqs=max_num_seqs,
                     max_batch_tokens=max_batch_tokens, num_pages=num_pages,
                     kv_dtype=default_kv_dtype(weights, dtype="float32", device="cpu"))
    if stored is None:
        stored = convert_tensors(ckpt.tensors, weights, ckpt.blocks)
    engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer, prefix_cache=prefix_cache)
    freeze_startup_objects()
    return engine


def flare_prefill(engine: Engine, ids: list[int]) -> float:
    t0, r = _run(engine, [GenerationRequest("p", ids, SamplingParams(max_tokens=1,
                                                                      temperature=0))])
    return len(ids) / ((r["first"]["p"] - t0) / 1e9)


def flare_decode(engine: Engine, ids: list[int], batch: int, n: int) -> float:
    reqs = [GenerationRequest(f"d{i}", ids, SamplingParams(max_tokens=n, temperature=0,
                                                           ignore_eos=True))
            for i in range(batch)]
    _, r = _run(engine, reqs)
    start = max(r["first"].values())
    end = max(r["done"].values())
    return batch * (n - 1) / ((end - start) / 1e9)


def hf_model(ckpt):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**ckpt.config.to_hf())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(ckpt.tensors, strict=False)
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def hf_prefill(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    model(x[:, :16])  # warm-up
    t = time.perf_counter()
    model(x)
    return len(ids) / (time.perf_counter() - t)


@torch.inference_mode()
def hf_decode(model, ids: list[int], batch: int, n: int) -> float:
    x = torch.tensor([ids] * batch)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    t = time.perf_counter()
    model.generate(x, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
    t2 = time.perf_counter()
    first = t1 - t  # prefill + one token
    return batch * (n - 1) / ((t2 - t1) - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--weights", choices=["fp16", "full", "q4", "q4x8"], default="fp16",
                    help="flare's weight format (default fp16, the CPU package default)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ckpt = load_checkpoint(args.model or embedded_model_path())
    engine = flare_engine(ckpt, args.weights)
    tok = ckpt.tokenizer
    short = _prompt(tok, 32)
    flare_decode(engine, short, 1, 8)  # warm-up
    rows = [
        ("prefill 512 tok/s", lambda e: flare_prefill(e, _prompt(tok, 512)),
         lambda m: hf_prefill(m, _prompt(tok, 512))),
        ("prefill 2048 tok/s", lambda e: flare_prefill(e, _prompt(tok, 2048)),
         lambda m: hf_prefill(m, _prompt(tok, 2048))),
        ("decode batch 1 tok/s", lambda e: flare_decode(e, short, 1, args.decode_tokens),
         lambda m: hf_decode(m, short, 1, args.decode_tokens)),
        ("decode batch 8 aggregate tok/s", lambda e: flare_decode(e, short, 8, args.decode_tokens),
         lambda m: hf_decode(m, short, 8, args.decode_tokens)),
    ]
    ours = [f(engine) for _, f, _ in rows]
    rss_flare = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    theirs = [None] * len(rows)
    if not args.skip_transformers:
        model = hf_model(ckpt)
        theirs = [g(model) for _, _, g in rows]
    rss_all = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"model: {ckpt.source.get('path', args.model)}  threads: {torch.get_num_threads()}  "
          f"torch {torch.__version__}  flare weights: {args.weights}")
    print(f"{'figure':34} {'flare':>10} {'transformers':>14}")
    for (name, _, _), a, b in zip(rows, ours, theirs):
        print(f"{name:34} {a:10.1f} {'-' if b is None else f'{b:14.1f}'}")
    print(f"peak RSS after flare runs: {rss_flare:.0f} MB; "
          f"after transformers too: {rss_all:.0f} MB")


if __name__ == "__main__":
    main()
