"""What a prefill or decode engine reports beyond the aggregated engine's reports (`reports.py`):
its bootstrap server's layout, its `/server_info` fields, its queues (`/v1/loads`, `/metrics`).
Pure, over the rooms of `disagg.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import EngineConfig
from .disagg import DecodeRooms, KVPoll, PrefillRooms


def prefill_layout(config: EngineConfig) -> dict[str, Any]:
    """What SGLang's bootstrap server answers for the prefill's layout (PrefillServerInfo)."""
    return {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
        # SGLang reports its --kv-cache-dtype as given.
        "page_size": config.block_size, "kv_cache_dtype": config.kv_cache_dtype,
        "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": config.port,
        "decode_allocation_policy": "early",
        # Filled in by each decode engine for itself; SGLang's server sends them empty.
        "target_tp_rank": None, "target_tp_ranks": None, "target_cp_ranks": None, "target_pp_ranks": None,
        "required_dst_info_num": None, "required_prefill_response_num": None,
    }


def server_info(config: EngineConfig, mode: str, kv_transfer_bandwidth_gb_s: float) -> dict[str, Any]:
    """The fields `/server_info` adds for a prefill or decode engine."""
    return {
        "disaggregation_mode": mode,
        # SGLang resolves mooncake_tcp to mooncake with TCP forced, and reports the result.
        "disaggregation_transfer_backend": ("mooncake" if config.disaggregation_transfer_backend == "mooncake_tcp"
                                            else config.disaggregation_transfer_backend),
        "disaggregation_bootstrap_port": config.disaggregation_bootstrap_port,
        "disaggregation_ib_device": config.disaggregation_ib_device,
        "disaggregation_decode_retraction_backup": config.disaggregation_decode_retraction_backup,
        "disaggregation_decode_enable_radix_cache": config.disaggregation_decode_enable_radix_cache,
        "disaggregation_decode_allocation_policy": "early",
        "num_reserved_decode_tokens": config.num_reserved_decode_tokens,
        "disable_radix_cache": not config.prefix_cache,
        "kv_transfer_link": config.kv_transfer_link,
        "kv_transfer_bandwidth_gb_s": kv_transfer_bandwidth_gb_s,
    }


@dataclass(frozen=True)
class PdQueues:
    """SGLang's PD queues, as rooms by state."""

    prefill_bootstrap: int
    prefill_inflight: int
    decode_prealloc: int
    decode_transfer: int


def pd_queues(prefill: PrefillRooms, decode: DecodeRooms) -> PdQueues:
    return PdQueues(
        prefill_bootstrap=prefill.count(KVPoll.BOOTSTRAPPING),
        prefill_inflight=prefill.count(KVPoll.TRANSFERRING),
        decode_prealloc=decode.count(KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT),
        decode_transfer=decode.count(KVPoll.TRANSFERRING),
    )


def with_disaggregation(loads: dict[str, Any], mode: str, queues: PdQueues, retracted: int,
                        last_transfer: tuple[float, float] | None) -> dict[str, Any]:
    """`/v1/loads` of a prefill or decode engine: its rank's load with a `disaggregation` section,
    the PD queues counted as waiting as SGLang counts them (bootstrap on a prefill, prealloc and
    transfer on a decode). `last_transfer`: (seconds, bytes) of the last finished KV transfer."""
    section: dict[str, Any] = {
        "mode": mode,
        "prefill_bootstrap_queue_reqs": queues.prefill_bootstrap,
        "prefill_inflight_queue_reqs": queues.prefill_inflight,
        "decode_prealloc_queue_reqs": queues.decode_prealloc,
        "decode_transfer_queue_reqs": queues.decode_transfer,
        "decode_retracted_queue_reqs": retracted,
        "kv_transfer_speed_gb_s": 0.0,
        "kv_transfer_latency_ms": 0.0,
    }
    if last_transfer is not None:
        seconds, num_bytes = last_transfer
        section["kv_transfer_latency_ms"] = seconds * 1000
        section["kv_transfer_speed_gb_s"] = num_bytes / seconds / 1e9 if seconds > 0 else 0.0
    load = dict(loads["loads"][0])
    load["num_waiting_reqs"] += queues.prefill_bootstrap + queues.decode_prealloc + queues.decode_transfer
    load["disaggregation"] = section
    return {**loads, "loads": [load]}
