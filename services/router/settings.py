from __future__ import annotations

from dataclasses import dataclass

from inferbus.runtime import settings as shared
from inferbus.runtime.settings import env
from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class RouterSettings:
    nats_url: str = shared.nats_url()
    router_id: str = env(
        "INFERBUS_ROUTER_ID", "", "This replica's id (default: router-<random>); names its placements on the bus."
    )
    policy: str = env(
        "INFERBUS_ROUTER_POLICY",
        "affinity",
        "Placement policy: affinity (prefix, adapter and load aware), least_loaded or round_robin.",
    )
    heartbeat_ttl_s: float = shared.heartbeat_ttl_s("Workers silent this long are dead (match the workers').")
    kv_ceiling: float = env(
        "INFERBUS_ROUTER_KV_CEILING", 0.95, "Workers whose KV cache is fuller than this get no new work."
    )
    temperature: float = env(
        "INFERBUS_ROUTER_TEMPERATURE",
        0.02,
        "Softmax temperature over the placement cost (seconds for affinity): spreads near-ties across workers and "
        "replicas.",
    )
    block_size: int = shared.block_size(
        DEFAULT_BLOCK_SIZE,
        "must match the gateways' and the workers' (workers rebuild engine cache events into these blocks).",
    )
    prefill_tokens_per_s: float = env(
        "INFERBUS_ROUTER_PREFILL_TOKENS_PER_S",
        10_000.0,
        "A worker's prefill rate, turning queued prompt tokens into seconds of wait in the cost.",
    )
    miss_weight: float = env(
        "INFERBUS_ROUTER_MISS_WEIGHT",
        5.0,
        "Weight of a request's uncached prompt tokens against queued ones: recomputing a prefix delays everything "
        "queued behind it too (about 1/(1-load)).",
    )
    decode_weight_s: float = env(
        "INFERBUS_ROUTER_DECODE_WEIGHT_S", 0.25, "Cost (seconds) of a worker whose every slot is busy decoding."
    )
    share_weight_s: float = env(
        "INFERBUS_ROUTER_SHARE_WEIGHT_S",
        1.0,
        "Cost (seconds) of a worker whose share of the fleet's recent traffic (prompt tokens placed, cached ones "
        "included) is half of the share limit above the mean; 0 turns the term off.",
    )
    share_limit: float = env(
        "INFERBUS_ROUTER_SHARE_LIMIT",
        0.15,
        "Share of recent traffic above the fleet's mean (0.15: 15%) at which a worker's cost grows without bound, so "
        "that even a cached family moves elsewhere.",
    )
    share_granularity: float = env(
        "INFERBUS_ROUTER_SHARE_GRANULARITY",
        15.0,
        "The share limit is never narrower than this many requests' worth of a worker's mean recent traffic: where "
        "workers see few requests, shares are mostly luck.",
    )
    share_window_s: float = env(
        "INFERBUS_ROUTER_SHARE_WINDOW_S", 300.0, "Time constant (seconds) over which a worker's recent traffic decays."
    )
    adapter_load_s: float = env(
        "INFERBUS_ROUTER_ADAPTER_LOAD_S",
        0.5,
        "Expected seconds of one LoRA adapter load on a worker that has not measured one yet (workers report their "
        "own, and their queued loads, which the placement cost counts).",
    )
    adapter_slot_hold_s: float = env(
        "INFERBUS_ROUTER_ADAPTER_SLOT_HOLD_S",
        2.0,
        "Mean seconds a running request keeps its LoRA adapter's batch slot: the unit of the expected wait for a free "
        "distinct-adapter slot.",
    )
    adapter_spread: float = env(
        "INFERBUS_ROUTER_ADAPTER_SPREAD",
        2.0,
        "Workers a hot LoRA adapter may run on per worker-equivalent of its traffic share (ceil(share x workers x "
        "this), at least 1).",
    )
    time_scale: float = env(
        "INFERBUS_ROUTER_TIME_SCALE",
        1.0,
        "Wall seconds per engine second: with simulated engines slowed down (`--time-scale`, set by `inferbus up "
        "--time-scale`), the LoRA adapter terms of the cost (load times, traffic shares, homes' lifetimes) run on "
        "engine time, as the token-based terms do. 1 for real engines.",
    )
    adapter_prefetch: bool = env(
        "INFERBUS_ROUTER_ADAPTER_PREFETCH",
        True,
        "Load registered LoRA adapters that no worker holds into the host memory of engines that cap it "
        "(--max-loaded-loras), up to the cap, one at a time per worker and behind every load a request waits for "
        "(docs/routing.md).",
    )
    kv_link: str = env(
        "INFERBUS_ROUTER_KV_LINK",
        "rdma",
        "Prefill/decode disaggregation: the link a prefill engine sends a prompt's KV to its decode engine over, "
        "priced in a pair's cost: `rdma` (between nodes, one 400 Gb/s NIC per GPU) or `nvlink` (inside a node, 450 "
        "GB/s per GPU each way), at line rate.",
    )
    index_blocks_per_worker: int = env(
        "INFERBUS_ROUTER_INDEX_BLOCKS", 250_000, "Prefix blocks remembered per worker (LRU beyond this)."
    )
    index_ttl_s: float = env("INFERBUS_ROUTER_INDEX_TTL_S", 900.0, "Prefix blocks untouched this long are forgotten.")
    recovery_scan_s: float = env(
        "INFERBUS_ROUTER_RECOVERY_SCAN_S",
        10.0,
        "How often to look for queues of workers that are gone (also done at once when one dies).",
    )
    canary_min_samples: int = env(
        "INFERBUS_CANARY_MIN_SAMPLES",
        200,
        "Canary SLO gate: interactive requests each release must finish in a step's window before any verdict "
        "(docs/releases.md).",
    )
    canary_latency_tolerance: float = env(
        "INFERBUS_CANARY_LATENCY_TOLERANCE",
        0.10,
        "Canary SLO gate: how much worse than the stable release's TTFT/TPOT p90 the candidate's may be (0.10: 10%).",
    )
    canary_error_tolerance: float = env(
        "INFERBUS_CANARY_ERROR_TOLERANCE", 0.002, "Canary SLO gate: allowed absolute increase of the error rate."
    )
    canary_cancel_tolerance: float = env(
        "INFERBUS_CANARY_CANCEL_TOLERANCE", 0.02, "Canary SLO gate: allowed absolute increase of the cancel rate."
    )
    canary_false_rollback: float = env(
        "INFERBUS_CANARY_FALSE_ROLLBACK",
        0.01,
        "Canary SLO gate: the probability, over a whole canary however often the gate is read, of rolling back a "
        "candidate no worse than the stable release (its sequential tests' level).",
    )
    canary_tick_s: float = env("INFERBUS_CANARY_TICK_S", 1.0, "How often the canary controller reads its gates.")
    metrics_port: int = shared.metrics_port(9101, "the router's")
    log_level: str = shared.log_level()
    otel_exporter: str = shared.otel_exporter()
