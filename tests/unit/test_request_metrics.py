"""`flare.server.metrics`: vLLM's buckets, one inter-token observation per text output
(never per token), request figures from the final output's server-clock timings."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flare.runtime.request import RequestOutput, RequestTimings
from flare.server.metrics import (ITL_BUCKETS, TTFT_BUCKETS, RequestMetrics, build_labels,
                                  token_buckets)

BUILD = {"version": "0", "package_id": "pkg", "format": "q4x8", "kernel_variant": "x",
         "device_class": "cpu"}


def test_token_buckets_are_vllms_1_2_5_series():
    assert token_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert token_buckets(1) == [1]
    with pytest.raises(ValueError):
        token_buckets(0)


def test_buckets_are_vllms():
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19


def _value(registry: CollectorRegistry, name: str) -> float:
    v = registry.get_sample_value(name)
    return 0.0 if v is None else v


def _run(metrics: RequestMetrics, outputs: list[RequestOutput]) -> list[RequestOutput]:
    async def source():
        for out in outputs:
            yield out

    async def consume():
        return [o async for o in metrics.observe(source())]

    return asyncio.run(consume())


def test_one_gap_per_text_output_and_request_figures_from_timings():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, 2048, BUILD)
    ms = 1_000_000
    timings = RequestTimings(arrival_ns=0, scheduled_ns=20 * ms, first_token_ns=70 * ms,
                             finished_ns=370 * ms)
    outputs = [
        RequestOutput("r", token_ids=[], text=""),                # a prefill-only step
        RequestOutput("r", token_ids=[5], text="Hel"),            # first text: no gap
        RequestOutput("r", token_ids=[6, 7, 8], text="lo, w"),    # 3 tokens: one gap
        RequestOutput("r", token_ids=[9], text=""),               # held back: no event
        RequestOutput("r", token_ids=[10], text="orld"),
        RequestOutput("r", token_ids=[2], text="", finished=True, finish_reason="stop",
                      num_prompt_tokens=11, num_completion_tokens=7, timings=timings),
    ]
    assert _run(metrics, outputs) == outputs  # passed through unchanged
    assert _value(registry, "flare_inter_token_latency_seconds_count") == 2
    for name, seconds in (("time_to_first_token_seconds", 0.07),
                          ("e2e_request_latency_seconds", 0.37),
                          ("request_queue_time_seconds", 0.02),
                          ("request_prefill_time_seconds", 0.05),
                          ("request_decode_time_seconds", 0.3)):
        assert _value(registry, f"flare_{name}_count") == 1, name
        assert _value(registry, f"flare_{name}_sum") == pytest.approx(seconds), name
    assert _value(registry, "flare_request_prompt_tokens_sum") == 11
    assert _value(registry, "flare_request_generation_tokens_sum") == 7
    text = generate_latest(registry).decode()
    assert 'flare_build_info{device_class="cpu",format="q4x8"' in text


def test_failed_and_unfinished_requests_are_not_observed():
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, 256, BUILD)
    failed = RequestOutput("r", finished=True, finish_reason="abort", error="boom",
                           timings=RequestTimings(arrival_ns=0, finished_ns=10))
    _run(metrics, [RequestOutput("r", token_ids=[1], text="a"), failed])
    _run(metrics, [RequestOutput("q", token_ids=[1], text="a")])  # client left: no finish
    assert _value(registry, "flare_e2e_request_latency_seconds_count") == 0
    assert _value(registry, "flare_request_prompt_tokens_count") == 0


def test_build_labels_without_a_manifest():
    labels = build_labels(None, "abc")
    assert labels["package_id"] == "abc" and labels["format"] == "unknown"
