"""Engine figures for the hybrid recipes (Qwen3.5 Gated DeltaNet, LFM2 short conv), one table.

Builds random checkpoints with tests/unit/hybrid_models.py's builders: `--size tiny` (the
default) the tiny models the tests use (5 layers, hidden 64, KV layers at 1 and 4);
`--size embedded` models of the embedded model's geometry (SmolLM2-135M: hidden 576,
30 layers, 9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49,152, tied embeddings) with
each recipe's own layer pattern (Qwen3.5: every 4th layer full attention, 7 of 30; LFM2:
its 16-layer conv/attention pattern tiled, 11 attention layers of 30). Both use the
embedded model's tokenizer. Each is saved with transformers' `save_pretrained`, prepared
with `prepare_package` and loaded through flare's loader. For each recipe, on one engine:
- prefill tok/s of a 512-token prompt (time to the first token, `max_tokens=1`);
- decode tok/s at batch 1 and aggregate decode tok/s at batch 8 (greedy, EOS ignored);
- TTFT of turn 10 of a 10-turn conversation with reuse on vs off: each turn's prompt is the
  previous prompt, its completion and a new user message (token level, as the server keeps
  them); an engine with `prefix_cache=True` and one with `prefix_cache=False` run the same
  turns; the figure is the median over `--repeats` conversations with distinct prefixes.
- same-prompt-twice TTFT: a 200-token prompt (below the 256-token checkpoint grid) sent
  again; with reuse it adopts the checkpoint one token before the prompt's end (len - 1
  cached); also the first send's TTFT with reuse on (the extra one-token step before the
  prompt's end) vs off;
- write-through (issue 18): the TTFT of turn 10 after turns 1-9 ran on an engine with a
  state folder that was then stopped without a save flag and replaced by a new engine on
  the folder (the restored state comes from what write-through wrote), and its cached
  tokens; decode tok/s of a continuous 8-stream load (24 requests of 64-128 tokens, so
  finishes and their writes overlap decode) with a state folder and write-through on vs
  off (ABBA rounds, medians), and the slowdown in percent.
Figures, not pass/fail: compare columns of one run, never numbers from another machine.
Tiny: about 75 s on one CPU thread (a fifth of it loading the tokenizer from the GGUF);
embedded: about 4 minutes on one thread with `--repeats 1` (building, saving and preparing
~135M random weights each). Keep one thread on a shared machine: with 2 threads on 2 busy
cores, Qwen3.5's many small DeltaNet ops each wait for a descheduled worker, and its
figures dropped more than tenfold (a 28-minute run).

    .venv/bin/python bench/bench_hybrid.py [--recipes qwen3_5,lfm2] [--size tiny|embedded]
        [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from flare.prepare.package import prepare_package
from flare.package.reader import load_package
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams

# the tests' builders, so the bench measures exactly the configs the tests check
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit"))
from hybrid_models import BUILDERS, SIZES  # noqa: E402

PLAN = dict(max_seq_len=2048, max_num_seqs=8, page_size=16, max_batch_tokens=512)
SYSTEM_TOKENS = 256  # shared prefix of a conversation (a system prompt and tools)
USER_TOKENS = 48  # each turn's new user message
REPLY_TOKENS = 16  # each turn's completion
TURNS = 10


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """`n` random token ids (distinct prompts: no accidental prefix reuse)."""
    return [rng.randrange(1000, vocab) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _run(engine: Engine, reqs: list[GenerationRequest]) -> dict[str, dict]:
    """Run `reqs` to completion; per request: first-token and done times (perf_counter ns)
    and the completion's token ids. Returns with the run's start time under key ""."""
    out: dict[str, dict] = {r.request_id: {"tokens": []} for r in reqs}

    def on_output(o):
        rec = out[o.request_id]
        if o.token_ids and "first" not in rec:
            rec["first"] = time.perf_counter_ns()
        rec["tokens"] += list(o.token_ids)
        if o.finished:
            rec["done"] = time.perf_counter_ns()
            rec["cached"] = o.num_cached_tokens

    engine.on_output = on_output
    t0 = time.perf_counter_ns()
    engine.run_until_idle(reqs)
    out[""] = {"t0": t0}
    return out


def prefill_tok_s(engine: Engine, prompt: list[int]) -> float:
    """Prompt tokens per second to the first token (`max_tokens=1`)."""
    r = _run(engine, [GenerationRequest("p", prompt, _greedy(1))])
    return len(prompt) / ((r["p"]["first"] - r[""]["t0"]) / 1e9)


def decode_tok_s(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Aggregate completion tokens per second after every sequence has its first token."""
    reqs = [GenerationRequest(f"d{i}", p, _greedy(n)) for i, p in enumerate(prompts)]
    r = _run(engine, reqs)
    start = max(r[q.request_id]["first"] for q in reqs)
    end = max(r[q.request_id]["done"] for q in reqs)
    return len(reqs) * (n - 1) / ((end - start) / 1e9)


def conversation_ttft(on: Engine, off: Engine, rng: random.Random, vocab: int,
                      tag: str) -> tuple[float, float, int, int]:
    """Run one `TURNS`-turn conversation on both engines (the same prompts: each turn's is
    the previous prompt, the reuse engine's completion and new user tokens).

    Returns:
        (TTFT ms of the last turn with reuse, without reuse, its prompt tokens, prompt
        tokens whose prefill the reuse engine skipped on it: `reused_tokens` counter delta).
    """
    history = _ids(rng, SYSTEM_TOKENS, vocab)
    ttft: dict[str, float] = {}
    for turn in range(TURNS):
        prompt = history + _ids(rng, USER_TOKENS, vocab)
        reused_before = on.reuse_counters.reused_tokens
        reply: list[int] = []
        for name, engine in (("on", on), ("off", off)):
            rid = f"{tag}-t{turn}"
            r = _run(engine, [GenerationRequest(rid, prompt, _greedy(REPLY_TOKENS))])
            ttft[name] = (r[rid]["first"] - r[""]["t0"]) / 1e6
            if name == "on":
                reply = r[rid]["tokens"]
        reused = on.reuse_counters.reused_tokens - reused_before
        history = prompt + reply
    return ttft["on"], ttft["off"], len(prompt), reused


def same_prompt_ttft(on: Engine, off: Engine, rng: random.Random, vocab: int,
                     tag: str, n: int = 200) -> tuple[float, float, float, int]:
    """A `n`-token prompt sent twice to each engine.

    Returns:
        (TTFT ms of the repeat with reuse, of the repeat without, of the first send with
        reuse, cached tokens of the repeat with reuse).
    """
    prompt = _ids(rng, n, vocab)
    first = _run(on, [GenerationRequest(f"{tag}-a", prompt, _greedy(4))])
    again = _run(on, [GenerationRequest(f"{tag}-b", prompt, _greedy(4))])
    _run(off, [GenerationRequest(f"{tag}-a", prompt, _greedy(4))])
    cold = _run(off, [GenerationRequest(f"{tag}-b", prompt, _greedy(4))])
    ms = lambda r, rid: (r[rid]["first"] - r[""]["t0"]) / 1e6  # noqa: E731
    return (ms(again, f"{tag}-b"), ms(cold, f"{tag}-b"), ms(first, f"{tag}-a"),
            again[f"{tag}-b"]["cached"])


def restart_ttft(pkg, folder: Path, rng: random.Random, vocab: int,
                 tag: str) -> tuple[float, int]:
    """Turns 1-9 of a `TURNS`-turn conversation on an engine with a state folder
    (write-through on, the default), a clean stop without a save flag, a new engine on
    the folder, then turn 10. Returns (its TTFT ms, its cached tokens)."""
    engine = Engine.from_package(pkg, prefix_cache=True, state_dir=folder)
    history = _ids(rng, SYSTEM_TOKENS, vocab)
    for turn in range(TURNS - 1):
        prompt = history + _ids(rng, USER_TOKENS, vocab)
        rid = f"{tag}-t{turn}"
        history = prompt + _run(engine, [GenerationRequest(rid, prompt,
                                                           _greedy(REPLY_TOKENS))])[rid]["tokens"]
    engine.stop()
    engine = Engine.from_package(pkg, prefix_cache=True, state_dir=folder)
    prompt, rid = history + _ids(rng, USER_TOKENS, vocab), f"{tag}-t{TURNS - 1}"
    r = _run(engine, [GenerationRequest(rid, prompt, _greedy(REPLY_TOKENS))])
    engine.stop()
    return (r[rid]["first"] - r[""]["t0"]) / 1e6, r[rid]["cached"]


def write_through_decode(pkg, root: Path, rng: random.Random, vocab: int,
                         repeats: int) -> tuple[float, float]:
    """Continuous decode at 8 streams with a state folder, write-through on and off.

    A round is 24 requests over the engine's 8 sequence slots, completions of 64 to 128
    tokens, so sequences finish at different steps and each finish's write-through (the
    records copied on the engine thread, then written by the transfer worker) overlaps
    the other streams' decode, as in a serving engine. The rounds run in ABBA order (on,
    off, off, on, ...) to cancel drift, and each waits for its engine's transfer queue to
    drain after the timed window, so one engine's background writes never land in the
    other's round. Returns medians of `repeats` rounds each (tok/s on, tok/s off): every
    completion token over the wall time from the first request's start to the last
    finish."""
    engines = {on: Engine.from_package(pkg, prefix_cache=True, state_dir=root / f"wt-{on}",
                                       write_through=on) for on in (True, False)}
    out: dict[bool, list[float]] = {True: [], False: []}
    for i in range(repeats):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            engine = engines[on]
            reqs = [GenerationRequest(f"w{i}-{j}", _ids(rng, 32, vocab),
                                      _greedy(64 + (j * 37) % 65)) for j in range(24)]
            r = _run(engine, reqs)
            end = max(r[q.request_id]["done"] for q in reqs)
            tokens = sum(len(r[q.request_id]["tokens"]) for q in reqs)
            out[on].append(tokens / ((end - r[""]["t0"]) / 1e9))
            engine.tiers.transfers.wait_idle(60.0)
    for engine in engines.values():
        engine.stop()
    return statistics.median(out[True]), statistics.median(out[False])


def bench_recipe(recipe: str, root: Path, tokenizer, repeats: int, size: str) -> dict:
    """Build, prepare and load the `size` random `recipe` model; measure its figures.

    Returns:
        The table row: tok/s (prefill, decode b1, b8), turn-10 TTFT ms on/off, reuse and
        state-pool figures.
    """
    folder = root / f"{size}-{recipe}"
    BUILDERS[recipe](folder, tokenizer, size=size)
    out = root / f"pkg-{recipe}"
    prepare_package(folder, out, progress=False, **PLAN)
    pkg = load_package(out)
    vocab = pkg.config.vocab_size
    rng = random.Random(f"bench-hybrid-{recipe}")
    on = Engine.from_package(pkg, prefix_cache=True)
    off = Engine.from_package(pkg, prefix_cache=False)
    decode_tok_s(on, [_ids(rng, 32, vocab)], 8)  # warm-up
    decode_tok_s(off, [_ids(rng, 32, vocab)], 8)
    prefill = statistics.median(prefill_tok_s(on, _ids(rng, 512, vocab)) for _ in range(3))
    dec1 = decode_tok_s(on, [_ids(rng, 32, vocab)], 128)
    dec8 = decode_tok_s(on, [_ids(rng, 32, vocab) for _ in range(8)], 128)
    runs = [conversation_ttft(on, off, rng, vocab, f"c{i}") for i in range(repeats)]
    same = [same_prompt_ttft(on, off, rng, vocab, f"s{i}") for i in range(repeats)]
    restarts = [restart_ttft(pkg, root / f"restart-{recipe}-{i}", rng, vocab, f"r{i}")
                for i in range(repeats)]
    wt_on, wt_off = write_through_decode(pkg, root / recipe, rng, vocab, repeats)
    mem = pkg.manifest.memory
    return {
        "recipe": recipe, "prefill": prefill, "dec1": dec1, "dec8": dec8,
        "ttft_on": statistics.median(r[0] for r in runs),
        "ttft_off": statistics.median(r[1] for r in runs),
        "turn10_prompt": runs[0][2],
        "turn10_reused": statistics.median(r[3] for r in runs),
        "same_on": statistics.median(r[0] for r in same),
        "same_off": statistics.median(r[1] for r in same),
        "same_first_on": statistics.median(r[2] for r in same),
        "same_cached": statistics.median(r[3] for r in same),
        "restart_ttft": statistics.median(r[0] for r in restarts),
        "restart_cached": statistics.median(r[1] for r in restarts),
        "wt_on": wt_on, "wt_off": wt_off,
        "state": (mem["state_slots"], mem["state_bytes_per_slot"], mem["state_pool_bytes"],
                  mem["kv_pool_bytes"], pkg.plan.checkpoint_interval),
    }


def print_table(head: str, lines: Iterable[str]) -> None:
    """Print a table: its header, a rule as wide, then one line per row."""
    print(head)
    print("-" * len(head))
    for line in lines:
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="qwen3_5,lfm2",
                    help="comma-separated recipes (default qwen3_5,lfm2)")
    ap.add_argument("--size", choices=SIZES, default="tiny",
                    help="tiny: the tests' 5-layer models (default); embedded: the embedded "
                         "model's geometry (hidden 576, 30 layers)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="conversations per recipe for the turn-10 TTFT median (default 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: ops of these tiny models are too small "
                         "to share, and on a busy machine waiting threads lose the CPU; 0 = "
                         "torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from flare.loading.embedded import embedded_model_path
    from flare.loading.tokenizer import load_tokenizer

    torch.manual_seed(0)
    t_start = time.perf_counter()
    gguf = embedded_model_path()
    tokenizer = load_tokenizer(gguf.parent, gguf_file=gguf.name, chat_template="{{ '' }}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="flare-bench-hybrid-") as tmp:
        for recipe in args.recipes.split(","):
            rows.append(bench_recipe(recipe.strip(), Path(tmp), tokenizer, args.repeats,
                                     args.size))
    print(f"{args.size} random hybrids (tests/unit/hybrid_models.py), fp32, cpu, threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}; plan {PLAN}")
    print(f"conversation: {SYSTEM_TOKENS}-token prefix, +{USER_TOKENS} user and "
          f"{REPLY_TOKENS} reply tokens a turn; turn 10 prompt {rows[0]['turn10_prompt']} "
          f"tokens; median of {args.repeats} conversations")
    print_table(f"{'recipe':8} {'prefill 512 tok/s':>17} {'decode b1 tok/s':>15} "
                f"{'decode b8 tok/s':>15} {'turn-10 TTFT on ms':>18} {'off ms':>8} "
                f"{'off/on':>7} {'reused tok':>10}",
                (f"{r['recipe']:8} {r['prefill']:17.0f} {r['dec1']:15.1f} {r['dec8']:15.1f} "
                 f"{r['ttft_on']:18.1f} {r['ttft_off']:8.1f} "
                 f"{r['ttft_off'] / r['ttft_on']:7.2f} {r['turn10_reused']:>10.0f}"
                 for r in rows))
    print_table(f"{'recipe':8} {'same prompt twice: TTFT on ms':>29} {'off ms':>8} "
                f"{'cached tok':>10} {'first send on ms':>16}",
                (f"{r['recipe']:8} {r['same_on']:29.1f} {r['same_off']:8.1f} "
                 f"{r['same_cached']:>10.0f} {r['same_first_on']:16.1f}" for r in rows))
    print_table(f"{'recipe':8} {'turn-10 TTFT after restart ms':>29} {'cached tok':>10} "
                f"{'decode b8 write-through on':>26} {'off tok/s':>9} {'slowdown':>8}",
                (f"{r['recipe']:8} {r['restart_ttft']:29.1f} {r['restart_cached']:>10.0f} "
                 f"{r['wt_on']:26.1f} {r['wt_off']:9.1f} "
                 f"{100 * (1 - r['wt_on'] / r['wt_off']):7.1f}%" for r in rows))
    for r in rows:
        slots, per_slot, pool, kv, every = r["state"]
        print(f"{r['recipe']}: state pool {slots} slots x {per_slot:,} B = {pool:,} B "
              f"(KV pool {kv:,} B); checkpoint every {every} prefill tokens")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
