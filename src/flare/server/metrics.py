"""Request histograms and build info on /metrics, with vLLM's names and buckets.

vLLM (`vllm/v1/metrics/loggers.py`) exports `vllm:<name>`; Flare exports the same
histograms as `flare_<name>`, the prefix of its other metrics:

| histogram | observed | unit |
|---|---|---|
| `flare_time_to_first_token_seconds` | first_token - arrival, per finished request | s |
| `flare_inter_token_latency_seconds` | gap between two outputs carrying text | s |
| `flare_e2e_request_latency_seconds` | finished - arrival | s |
| `flare_request_queue_time_seconds` | scheduled (first engine step) - arrival | s |
| `flare_request_prefill_time_seconds` | first_token - scheduled | s |
| `flare_request_decode_time_seconds` | finished - first_token | s |
| `flare_request_prompt_tokens` | prompt tokens of a finished request | tokens |
| `flare_request_generation_tokens` | completion tokens of a finished request | tokens |

Request durations come from the engine's server-clock timestamps (`RequestTimings`, the
same figures as the `flare` extension object of a response), so a histogram's sum equals
the sum of the responses' own differences. Arrival is when the HTTP request was received.

Inter-token latency is observed once per engine output that carries text, the unit a
stream sends as one event: the time between its arrival on the event loop and the previous
text output's (server monotonic clock). An output that carries several tokens is one
observation; per-token latencies are never invented by dividing. The first text output
of a request opens the series (it is time to first token, not an inter-token gap).

`flare_build_info` is a gauge of value 1 whose labels say what is served: `version`
(flare's), `package_id`, `format` (the weight format recorded in the manifest's tuning),
`kernel_variant` (the instruction-set target of the CPU kernel variant this process runs,
`flare.kernels.isa_variant`, e.g. "x86-64+avx2+fma+f16c", or the CUDA device class) and
`device_class`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram

from flare.runtime.request import RequestOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_value: int) -> list[int]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max_value` (the
    context length for token-count histograms).

    Raises:
        ValueError: `max_value` < 1.
    """
    if max_value < 1:
        raise ValueError(f"max_value must be at least 1, got {max_value}")
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


def build_labels(manifest: Any | None, package_id: str = "") -> dict[str, str]:
    """Labels of `flare_build_info` from a package manifest (None: what is known without
    one: the version and `package_id`, the rest "unknown")."""
    import flare

    tuning = getattr(manifest, "tuning", None) or {}
    device_class = str(getattr(manifest, "device_class", "") or "unknown")
    if device_class == "cpu":
        from flare.kernels import ISA_TARGET, KernelUnavailable, isa_target, isa_variant

        try:  # chosen when the engine loaded its kernels; no build where there is none
            variant = isa_target(isa_variant())
        except KernelUnavailable:  # the CPU or $FLARE_KERNEL_ISA rules them out
            variant = ISA_TARGET
    else:
        variant = device_class
    return {
        "version": flare.__version__,
        "package_id": str(getattr(manifest, "package_id", "") or package_id or "unknown"),
        "format": str(tuning.get("weights", "full") if manifest is not None else "unknown"),
        "kernel_variant": variant,
        "device_class": device_class,
    }


def _seconds(start_ns: int | None, end_ns: int | None) -> float | None:
    if start_ns is None or end_ns is None:
        return None
    return max(0, end_ns - start_ns) / 1e9


class RequestMetrics:
    """The request histograms and `flare_build_info`, registered in `registry`.

    Args:
        registry: the app's `CollectorRegistry` (what /metrics serves).
        max_model_len: the context length (tokens): the top of the token buckets.
        build: the `flare_build_info` labels (`build_labels`).
    """

    def __init__(self, registry: CollectorRegistry, max_model_len: int,
                 build: Mapping[str, str]) -> None:
        def hist(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(f"flare_{name}", doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds",
                         "Time to first token in seconds (server clock, from arrival).",
                         TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds",
                        "Time between two text outputs of a request in seconds (one "
                        "observation per streamed event, never per token).", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds",
                        "End-to-end request latency in seconds (arrival to finish).",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Time from arrival to the first engine step in seconds.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds",
                            "Time from the first engine step to the first token in seconds.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds",
                           "Time from the first token to the finish in seconds.",
                           REQUEST_LATENCY_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = hist("request_prompt_tokens",
                                  "Prompt tokens of a finished request.", tokens)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Completion tokens of a finished request.", tokens)
        info = Gauge("flare_build_info", "What is served: flare version, package, weight "
                     "format, kernel variant (value 1).", list(build), registry=registry)
        info.labels(**build).set(1)

    def finished(self, out: RequestOutput) -> None:
        """Observe a finished request's durations and token counts (its final output)."""
        t = out.timings
        if t is None or out.error is not None:  # a failed request has no latency to show
            return
        for hist, value in ((self.ttft, _seconds(t.arrival_ns, t.first_token_ns)),
                            (self.e2e, _seconds(t.arrival_ns, t.finished_ns)),
                            (self.queue, _seconds(t.arrival_ns, t.scheduled_ns)),
                            (self.prefill, _seconds(t.scheduled_ns, t.first_token_ns)),
                            (self.decode, _seconds(t.first_token_ns, t.finished_ns))):
            if value is not None:
                hist.observe(value)
        self.prompt_tokens.observe(out.num_prompt_tokens)
        self.generation_tokens.observe(out.num_completion_tokens)

    async def observe(self, stream: AsyncIterator[RequestOutput]
                      ) -> AsyncIterator[RequestOutput]:
        """`stream` (one engine request's outputs) unchanged, observed on the way: an
        inter-token gap per text output after the first, the request figures at its
        finish. Closing the result closes `stream` (which aborts the request)."""
        last_ns: int | None = None
        try:
            async for out in stream:
                if out.text:
                    now = time.monotonic_ns()
                    if last_ns is not None:
                        self.itl.observe((now - last_ns) / 1e9)
                    last_ns = now
                if out.finished:
                    self.finished(out)
                yield out
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
