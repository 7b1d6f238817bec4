"""The fleet simulator's disaggregated fleet (tools/capacity/fleetsim/pd.py)."""

from __future__ import annotations

import pytest

from inferbus.timing import KV_LINKS, kv_link, roofline
from services.sim_engine.config import EngineConfig
from tools.capacity.fleetsim.pd import PdConfig, PdFleet, Pool


def _engine(tp: int) -> EngineConfig:
    return EngineConfig(gpu="H100", tp=tp, chunked_prefill_size=2048)


def _pd(link: str = "rdma", gb_s: float | None = None) -> PdConfig:
    return PdConfig(decode=Pool(1, _engine(4)), prefill=Pool(1, _engine(8)), link=kv_link(link, gb_s))


def _agg(tp: int = 8) -> PdConfig:
    return PdConfig(decode=Pool(1, _engine(tp)))


def _one(config: PdConfig, arrivals: list[tuple[float, int, int, int]]) -> PdFleet:
    fleet = PdFleet(config, arrivals)
    fleet.run()
    return fleet


def test_ttft_is_the_prefill_then_the_transfer_then_a_decode_step() -> None:
    request = [(0.0, 8192, 10, 0)]
    agg = _one(_agg(8), request).finished[0]
    pd = _one(_pd(), request).finished[0]
    # The prefill runs on the same TP8 engine either way (nothing else in its steps); then the
    # prompt's KV crosses RDMA (the decode side's 4 GPUs set the pace) and the decode replica's
    # first step, one prompt token at the prompt's context, emits the first token.
    transfer = KV_LINKS["rdma"].transfer_s(8192, 8, 4)
    assert transfer == pytest.approx(8192 * 163_840 / (4 * 50e9))
    first_step = roofline("H100", 4).step_time(0, 0, 1, 8191.5)
    assert pd.first - agg.first == pytest.approx(transfer + first_step, rel=1e-9)
    assert pd.finish > pd.first and pd.replica is not None and pd.replica.name == "decode-0"


def test_a_slower_link_delays_the_first_token_by_the_difference() -> None:
    request = [(0.0, 8192, 10, 0)]
    fast = _one(_pd(), request).finished[0]
    slow = _one(_pd("rdma", 5.0), request).finished[0]
    extra = kv_link("rdma", 5.0).transfer_s(8192, 8, 4) - KV_LINKS["rdma"].transfer_s(8192, 8, 4)
    assert slow.first - fast.first == pytest.approx(extra, rel=1e-9)


def test_the_decode_side_reserves_the_prompts_kv_until_it_lands() -> None:
    fleet = PdFleet(_pd(), [])
    decoder = fleet.decoders[0]
    capacity = decoder.kv_capacity
    fleet._arrive(0.0, 30_000, 5, 0)
    assert decoder.kv_capacity == capacity - 30_001  # reserved while the prompt is prefilled and sent
    assert fleet.incoming == [1]
    fleet.loop.run()
    assert decoder.kv_capacity == capacity and fleet.reserved == [0] and fleet.incoming == [0]
    assert len(fleet.finished) == 1
    assert fleet.kv_peak == pytest.approx(30_001 / capacity)


def test_reservations_hold_back_the_decode_replicas_admission() -> None:
    # A decode replica reserving almost all its KV for prompts in flight cannot admit more work:
    # the next landed request waits for room.
    fleet = PdFleet(_pd(), [])
    decoder = fleet.decoders[0]
    capacity = decoder.kv_capacity
    fleet._arrive(0.0, capacity - 2000, 2, 0)
    assert decoder.kv_capacity == 1999
    fleet._arrive(0.0, 4000, 2, 0)  # no room anywhere: placed where the most is left, and waits
    fleet.loop.run()
    assert len(fleet.finished) == 2
    big, small = sorted(fleet.finished, key=lambda r: r.input, reverse=True)
    assert small.first >= big.finish - 1e-9  # the small one's KV found room only once the big one left


def test_decode_streams_are_not_stalled_by_prefill_chunks() -> None:
    # A stream decoding when a 30k-token prompt arrives: aggregated, every chunk step of that prompt
    # is one of its steps; disaggregated, the prompt runs on the prefill replica.
    # Every replica is TP8, so the decode steps themselves cost the same.
    arrivals = [(0.0, 100, 40, 0), (0.05, 30_000, 2, 0)]
    agg = min(_one(_agg(8), arrivals).finished, key=lambda r: r.input)
    pd_config = PdConfig(decode=Pool(1, _engine(8)), prefill=Pool(1, _engine(8)))
    pd = min(_one(pd_config, arrivals).finished, key=lambda r: r.input)
    tpot = lambda r: (r.finish - r.first) / (r.output - 1)  # noqa: E731
    assert tpot(agg) > 2 * tpot(pd)
    assert tpot(pd) < 0.011


def test_summary_counts_goodput_and_minutes() -> None:
    arrivals = [(float(i), 2000, 20, 0) for i in range(120)]
    summary = PdFleet(_pd(), arrivals).run()
    assert summary.requests == summary.completed == 120
    assert summary.topology == "disaggregated" and summary.gpus == 12
    assert summary.request_attainment == 1.0 and summary.minute_attainment == 1.0
    assert summary.goodput_rps == pytest.approx(120 / 119)
    assert summary.goodput_per_gpu == pytest.approx(summary.goodput_rps / 12)
    assert summary.transfer_mean_s == pytest.approx(KV_LINKS["rdma"].transfer_s(2000, 8, 4), rel=1e-6)
    tight = PdFleet(PdConfig(decode=Pool(1, _engine(4)), prefill=Pool(1, _engine(8)), slo_ttft_s=0.05), arrivals).run()
    assert tight.request_attainment == 0.0 and tight.minute_attainment == 0.0 and tight.goodput_rps == 0.0


def test_every_pool_needs_a_replica() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        PdFleet(PdConfig(decode=Pool(1, _engine(4)), prefill=Pool(0, _engine(8))), [(0.0, 10, 2, 0)]).run()
