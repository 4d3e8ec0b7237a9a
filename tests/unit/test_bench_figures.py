"""The arithmetic and bookkeeping bench/peers.py's figures rest on (pure functions; the
benchmark itself is never a timed test)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_agent_session import later_median, session_ttfts
from bench_attention import _paged_gather, attention_flops
from kquant_files import kind_of, needs_requantize
from machine_limits import isa_flags
from peers import linear_params, prefill_flops_per_token, prefill_share

# the embedded model's shape
CFG = SimpleNamespace(hidden_size=576, head_dim=64, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, num_hidden_layers=30,
                      vocab_size=49152)


def test_prefill_share_puts_linear_flops_at_their_peak_and_attention_at_fp32():
    # one peak for both: tokens/s x FLOPs per token / peak
    peak = 100e9
    share = prefill_share(CFG, 2048, 500.0, peak, peak)
    assert share == pytest.approx(500.0 * prefill_flops_per_token(CFG, 2048) / peak)
    # an int8 peak twice the fp32 one halves only the linear part's time
    layers, _ = linear_params(CFG)
    attention = prefill_flops_per_token(CFG, 2048) - 2 * layers
    assert prefill_share(CFG, 2048, 500.0, 2 * peak, peak) == pytest.approx(
        500.0 * (layers / peak + attention / peak))


def test_attention_flops_count_each_causal_pair_once():
    # row r of 3 after 5 cached tokens sees 6, 7, 8 keys: 21 pairs, 4 x head_dim each
    assert attention_flops(3, 5, heads=2, head_dim=8) == 21 * 2 * 4 * 8
    assert attention_flops(1, 0, heads=1, head_dim=1) == 4


def test_paged_gather_hands_each_sequence_whole_pages_of_its_own():
    g = _paged_gather(3, 40, 16 * 12, torch.Generator().manual_seed(1))
    assert g.shape == (3, 40) and g.dtype == torch.int64
    assert len(set(g.flatten().tolist())) == 3 * 40  # no slot shared
    for row in g.tolist():
        for start in range(0, 40, 16):  # a page is 16 consecutive slots from a page start
            page = row[start:start + 16]
            assert page[0] % 16 == 0 and page == list(range(page[0], page[0] + len(page)))


def test_session_ttfts_rotates_the_order_and_stops_at_the_deadline():
    calls = []

    def target(name):
        return lambda messages: calls.append((name, len(messages))) or (1.0, {})

    targets = {"a": target("a"), "b": target("b"), "c": target("c")}
    rows = session_ttfts([[{}]] * 4, targets)
    assert len(rows) == 4 and all(set(r) == {"a", "b", "c"} for r in rows)
    assert [c[0] for c in calls[:9]] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    # no turn starts after the deadline
    assert session_ttfts([[{}]] * 4, targets, deadline=time.monotonic() - 1) == []
    # the median leaves the first turn out; fewer than 2 turns: none
    turns = [{"a": (ms, {})} for ms in (900.0, 10.0, 30.0, 20.0)]
    assert later_median(turns, "a") == 20.0
    assert later_median(turns[:1], "a") is None


def test_kquant_files_requantize_only_quantized_sources():
    assert needs_requantize(Counter({"Q4_1": 210, "Q8_0": 1}))  # the embedded model
    assert not needs_requantize(Counter({"F16": 210, "F32": 1}))
    assert kind_of(" q4_k_m") == "Q4_K_M"
    with pytest.raises(ValueError, match="Q6_K"):
        kind_of("q3_k")


def test_isa_flags_keeps_what_decides_the_kernels():
    flags = frozenset({"sse4_2", "f16c", "fma", "avx2", "avx512f", "avx512_vnni", "avx_vnni",
                       "amx_tile", "avx512bw"})
    assert isa_flags(flags) == ["amx_tile", "avx2", "avx512_vnni", "avx512bw", "avx512f",
                                "avx_vnni", "fma"]
    assert isa_flags(None) == []


def test_peak_rss_line_holds_the_peak_against_the_report_and_its_margin():
    from bench_memory import TARGET_MIB
    from peers import peak_rss_line

    mib = 1 << 20
    within = peak_rss_line((1000 + TARGET_MIB) * mib, 1000 * mib)
    assert f"peak - report +{TARGET_MIB} MiB" in within and "within" in within
    assert "over" in peak_rss_line((1001 + TARGET_MIB) * mib, 1000 * mib)
    assert "unread" in peak_rss_line(None, 1000 * mib)
