"""The simulated engine's injected GPU faults: a hang stops every request's progress while the
server still answers /ready; a failure answers generations and health checks with 500; both only
with fault injection on."""

from __future__ import annotations

import asyncio

import pytest

from .test_sim_server import running

GENERATE = {"text": "hello there", "sampling_params": {"max_new_tokens": 8}}


async def test_without_fault_injection_there_is_no_fault_endpoint() -> None:
    async with running() as (_server, client):
        assert (await client.post("/fault", json={"mode": "hang"})).status_code in (404, 405)


@pytest.mark.slow
async def test_a_hung_engine_answers_ready_but_makes_no_progress_until_it_is_unhung() -> None:
    async with running() as (server, client):
        server.enable_faults()
        assert (await client.post("/fault", json={"mode": "hang"})).json() == {"mode": "hang"}
        generation = asyncio.create_task(client.post("/generate", json=GENERATE))
        await asyncio.sleep(0.5)
        assert not generation.done()
        assert (await client.get("/ready")).status_code == 200
        assert (await client.get("/fault")).json() == {"mode": "hang"}
        await client.post("/fault", json={"mode": "none"})
        answer = await asyncio.wait_for(generation, 10)
        assert answer.status_code == 200 and answer.json()["meta_info"]["completion_tokens"] == 8


async def test_a_failing_engine_answers_500_and_bad_modes_are_refused() -> None:
    async with running() as (server, client):
        server.enable_faults("fail")
        assert (await client.post("/generate", json=GENERATE)).status_code == 500
        assert (await client.get("/health")).status_code == 500
        assert (await client.post("/fault", json={"mode": "melt"})).status_code == 400
        await client.post("/fault", json={"mode": "none"})
        assert (await client.post("/generate", json=GENERATE)).status_code == 200

