"""The simulated engine's Prometheus series: SGLang's names, buckets and `model_name` label, in a
registry per engine (each engine process has its own, as SGLang's)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    """The series every engine exports (`/metrics`)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.num_running = Gauge("sglang:num_running_reqs", "Running requests.", labels, registry=r).labels(model_name)
        self.num_queue = Gauge("sglang:num_queue_reqs", "Waiting requests.", labels, registry=r).labels(model_name)
        self.token_usage = Gauge("sglang:token_usage", "KV cache usage (0-1).", labels, registry=r).labels(model_name)
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "Prefix cache hit rate.", labels, registry=r).labels(
            model_name
        )
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens.", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("sglang:generation_tokens", "Generated tokens.", labels, registry=r).labels(
            model_name
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            registry=r,
            buckets=(0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60),
        ).labels(model_name)
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Time between tokens.",
            labels,
            registry=r,
            buckets=(0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1),
        ).labels(model_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency.",
            labels,
            registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
        ).labels(model_name)


class PdMetrics:
    """SGLang's PD series (its metrics_collector's names and buckets), in the engine's registry."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"sglang:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        self.prefill_bootstrap = gauge("num_prefill_bootstrap_queue_reqs", "Requests in the prefill bootstrap queue.")
        self.prefill_inflight = gauge("num_prefill_inflight_queue_reqs", "Requests in the prefill inflight queue.")
        self.decode_prealloc = gauge("num_decode_prealloc_queue_reqs", "Requests in the decode prealloc queue.")
        self.decode_transfer = gauge("num_decode_transfer_queue_reqs", "Requests in the decode transfer queue.")
        self.transfer_speed = Histogram("sglang:kv_transfer_speed_gb_s", "KV cache transfer speed in GB/s.",
                                        ["model_name"], registry=registry,
                                        buckets=(0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)).labels(model_name)
        self.transfer_latency = Histogram(
            "sglang:kv_transfer_latency_ms",
            "KV cache transfer latency in ms.",
            ["model_name"],
            registry=registry,
            buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
        ).labels(model_name)
