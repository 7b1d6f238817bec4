"""The profile table (Dynamo mocker format) built from the roofline, read back, and driving the engine."""

import zipfile

import pytest
from click.testing import CliRunner

from inferbus.timing import roofline
from services.sim_engine.closed_loop import simulate_closed_loop
from services.sim_engine.config import EngineConfig
from services.sim_engine.profile_table import (
    ProfileTable,
    TableStepModel,
    build_table,
    load_npz,
    save_npz,
)


@pytest.fixture(scope="module")
def model():
    return roofline("H100", 2)


@pytest.fixture(scope="module")
def table(model):
    return build_table(model)


def test_table_reproduces_the_roofline_where_it_was_sampled(model, table):
    for n in (512, 2048, 8192):
        assert table.prefill_time_ms(n) == pytest.approx(model.step_time(0, 0, n, n / 2) * 1000, rel=0.01)
    for batch, context in ((1, 2048), (32, 2048), (128, 4096)):
        kv = batch * context
        assert table.decode_time_ms(kv, context) == pytest.approx(model.step_time(batch, kv) * 1000, rel=0.03)


def test_step_is_prefill_plus_decode_as_the_mocker_composes_it(table):
    step = TableStepModel(table)
    assert step.step_time(0, 0, 0) == 0.0
    both = step.step_time(16, 16 * 1000, 512, 256.0)
    assert both == pytest.approx((table.prefill_time_ms(512) + table.decode_time_ms(16_000, 1000)) / 1000)
    assert step.step_time(0, 0, 512, 9999.0) == pytest.approx(table.prefill_time_ms(512) / 1000)


def test_interpolation_is_linear_between_points_and_extrapolates():
    table = ProfileTable((0.0, 100.0), (10.0, 20.0), (0.0, 1000.0), (1.0, 11.0), ((20.0, 30.0), (40.0, 50.0)))
    assert table.prefill_time_ms(50) == pytest.approx(15.0)
    assert table.prefill_time_ms(200) == pytest.approx(30.0)  # beyond the last point, the last slope
    assert table.decode_time_ms(500, 6.0) == pytest.approx(35.0)  # bilinear centre
    assert table.decode_time_ms(2000, 1.0) == pytest.approx(60.0)


def test_npz_round_trip_with_the_mocker_array_names(tmp_path, table):
    path = tmp_path / "perf.npz"
    save_npz(table, path)
    with zipfile.ZipFile(path) as archive:
        assert sorted(archive.namelist()) == sorted(
            f"{name}.npy" for name in
            ("prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length", "decode_itl"))
    assert load_npz(path) == table


def test_bad_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        ProfileTable((1.0, 1.0), (1.0, 2.0), (0.0, 1.0), (1.0, 2.0), ((1.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ValueError, match="one row per"):
        ProfileTable((1.0, 2.0), (1.0, 2.0), (0.0, 1.0), (1.0, 2.0), ((1.0, 1.0),))
    import numpy as np

    path = tmp_path / "other.npz"
    np.savez(path, prefill_isl=np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="missing array"):
        load_npz(path)
    text = tmp_path / "text.npz"
    text.write_text("not a table")
    with pytest.raises(ValueError, match="cannot read"):
        load_npz(text)


def test_engine_runs_from_the_table_as_from_the_model_it_was_built_from(tmp_path, model, table):
    path = tmp_path / "perf.npz"
    save_npz(table, path)
    from_table = simulate_closed_loop(EngineConfig(profile_table=str(path)), 8, 1024, 64, n_requests=16)
    # Same engine, the table's own composition: prefill and decode of one step priced apart.
    direct = simulate_closed_loop(EngineConfig(), 8, 1024, 64, n_requests=16, step_model=TableStepModel(table))
    assert from_table == direct
    roofline_run = simulate_closed_loop(EngineConfig(), 8, 1024, 64, n_requests=16)
    # A step that prefills and decodes pays the weight read twice from the table, once in the roofline.
    assert roofline_run.mean_itl_s < from_table.mean_itl_s < 1.25 * roofline_run.mean_itl_s


def _engine_with_one_decoding_request(mixed_chunk: bool):
    from services.sim_engine.request import Request
    from services.sim_engine.sampling import SamplingParams
    from services.sim_engine.scheduler import Engine

    engine = Engine(EngineConfig(mixed_chunk=mixed_chunk, chunked_prefill_size=512))
    engine.add(Request(rid="a", input_ids=list(range(1, 101)), sampling=SamplingParams(max_new_tokens=50)))
    engine.step()  # "a" prefilled, first token out
    engine.add(Request(rid="b", input_ids=list(range(1000, 2024)), sampling=SamplingParams(max_new_tokens=5)))
    return engine


def test_unmixed_scheduling_prefills_alone_then_decodes():
    """SGLang's default (and Dynamo's mocker in SGLang mode): no decode in a step that prefills."""
    engine = _engine_with_one_decoding_request(mixed_chunk=False)
    first = engine.step()
    assert (first.batch_decode, first.prefill_tokens) == (0, 512)
    second = engine.step()  # b's last chunk: b's first token; a still waits
    assert (second.batch_decode, second.prefill_tokens) == (0, 512)
    third = engine.step()
    assert (third.batch_decode, third.prefill_tokens) == (2, 0)
    mixed = _engine_with_one_decoding_request(mixed_chunk=True).step()
    assert (mixed.batch_decode, mixed.prefill_tokens) == (1, 512)


def test_config_refuses_two_timing_sources():
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(fixed_step_ms=1.0, profile_table="perf.npz")


def test_cli_writes_a_table_the_engine_accepts(tmp_path):
    from tools.commands.main import main

    out = tmp_path / "h200.npz"
    result = CliRunner().invoke(main, ["profile-table", "--gpu", "H200", "--tp", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1,103,759 KV tokens" in result.output
    assert load_npz(out).decode_kv_tokens[-1] == pytest.approx(1_103_759)
    bad = tmp_path / "bad.npz"
    bad.write_text("x")
    result = CliRunner().invoke(main, ["sim-engine", "--profile-table", str(bad)])
    assert result.exit_code == 2
    assert "--profile-table" in result.output


async def test_server_reports_its_timing_source_and_scheduling(tmp_path, table):
    import httpx

    from services.sim_engine.server import SimEngineServer

    path = tmp_path / "perf.npz"
    save_npz(table, path)
    server = SimEngineServer(EngineConfig(time_scale=0.0, profile_table=str(path), mixed_chunk=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://sim") as client:
        info = (await client.get("/server_info")).json()
    assert info["profile_table"] == str(path) and info["enable_mixed_chunk"] is False
    assert isinstance(server.engine.step_model, TableStepModel)
