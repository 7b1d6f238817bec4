"""The router's tuning, shared by the worker registry and every policy."""

from __future__ import annotations

from dataclasses import dataclass

from inferbus.tokens.blocks import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class RoutingConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    heartbeat_ttl_s: float = 3.0
    kv_ceiling: float = 0.95
    # Softmax temperature, in the cost's unit (seconds for affinity, requests per slot for
    # least-loaded): choices within about this much of the best share the traffic.
    temperature: float = 0.02
    # Prompt tokens one worker prefills per second: turns tokens into seconds of queueing. It only
    # needs to be about right; the ranking of workers does not depend on its exact value much.
    prefill_tokens_per_s: float = 10_000.0
    # Weight of this request's own uncached prefill against queued work. Recomputing a prefix delays
    # not only this request but every request queued behind it on that worker; at the ~80% load a
    # fleet is sized for, that displaced work is worth about 1/(1-ρ) ≈ 5 times the request's own
    # wait. In the fleet simulator on the Mooncake trace, 4-10 all beat 1.5 clearly (docs/routing.md).
    miss_weight: float = 5.0
    decode_weight_s: float = 0.25  # cost of a worker whose every slot is decoding
    adapter_load_s: float = 0.5  # one adapter load, until the worker reports its measured time
    adapter_slot_hold_s: float = 2.0  # mean time a running request holds its adapter's batch slot
    adapter_spread: float = 2.0  # workers a hot adapter may use per worker-equivalent of its traffic
    # Wall seconds per engine second (simulated engines slowed down for a benchmark). The token
    # terms are engine seconds already (tokens ÷ an engine's rate); the adapter terms read the
    # clock and the workers' measured load times, so they are converted (adapter_slots.py).
    time_scale: float = 1.0
    # Weight of the KV tokens a worker's requests hold (cached prefix included) against prefill
    # tokens, after Dynamo's KV router (cost = overlap weight × prefill blocks + active blocks). A
    # worker holding a hot family's long cached prompts is busier than its uncached work shows. In
    # the fleet simulator (Mooncake synthetic, 4 replicas, 5 family samples, with the share term
    # below) 0.1 gave the best TTFT p90 (0.9× that of 0.4) at the same imbalance and hit rate, and
    # 0.9× on the conversation trace, where no cache helps; 1.0 (Dynamo's default) spreads worse.
    active_kv_weight: float = 0.1
    # A worker's share of the fleet's recent traffic (prompt tokens placed there, cached ones
    # included, decaying over `share_window_s`) against the fleet's mean, priced by
    # `registry.share_cost`: `share_weight_s` at half of `share_limit` above the mean, without
    # bound towards the limit. Families come back to the worker that caches them (a median 55 s
    # later on the Mooncake trace), so a worker's recent share predicts its next one, which the
    # instantaneous load terms cannot see coming; near the limit even a long cached prefix spills.
    # In the fleet simulator (Mooncake synthetic, 4 replicas, 5 family samples × 3 simulator
    # seeds) it kept every run's imbalance of all tokens at or below 1.13 (without it: up to 1.22)
    # for half a point of hit rate (bench/results/routing_tune_share.md). 0 turns it off. A share
    # over few requests is mostly the luck of their sizes: the limit is never narrower than
    # `share_granularity` requests' worth of the mean (on 200 replicas at 833 req/s a limit of
    # 0.15 cost affinity half its hit rate).
    share_weight_s: float = 1.0
    share_limit: float = 0.15
    share_granularity: float = 15.0
    share_window_s: float = 300.0
    index_blocks_per_worker: int = 250_000
    index_ttl_s: float = 900.0
