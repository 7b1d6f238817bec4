"""The router's tuning, shared by the worker registry and every policy."""

from __future__ import annotations

from dataclasses import dataclass

from inferbus.tokens import DEFAULT_BLOCK_SIZE


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
    # Weight of the KV tokens a worker's requests hold (cached prefix included) against prefill
    # tokens, after Dynamo's KV router (cost = overlap weight × prefill blocks + active blocks). A
    # worker holding a hot family's long cached prompts is busier than its uncached work shows. In
    # the fleet simulator (Mooncake synthetic, 4 replicas, 5 family samples) 0.4 took the mean load
    # imbalance from 1.14 to 1.09 for about 2% of hit rate; 1.0 (Dynamo's default) lost a tenth of it.
    active_kv_weight: float = 0.4
    index_blocks_per_worker: int = 250_000
    index_ttl_s: float = 900.0
