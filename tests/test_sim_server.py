import asyncio
import json
import socket

import httpx
import pytest
import uvicorn

from services.sim_engine.config import EngineConfig
from services.sim_engine.server import SimEngineServer

from .waiting import await_for


def make_client(**overrides) -> tuple[SimEngineServer, httpx.AsyncClient]:
    # Answers end only at max_new_tokens or a stop: these tests count tokens, and a sampled
    # request's answer length is drawn from its random rid.
    settings = {"time_scale": 0.0, "fixed_step_ms": 10.0, "lora_load_time_s": 0.0, "answer_length_median": 0}
    settings.update(overrides)
    server = SimEngineServer(EngineConfig(**settings))
    return server, httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://sim")


class running:
    """A real uvicorn server on a free port (httpx's ASGI transport buffers streamed bodies)."""

    def __init__(self, **overrides):
        settings = {"time_scale": 0.0, "fixed_step_ms": 10.0, "lora_load_time_s": 0.0, "answer_length_median": 0}
        settings.update(overrides)
        self.server = SimEngineServer(EngineConfig(**settings))

    async def __aenter__(self):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        config = uvicorn.Config(self.server.app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
        self._uvicorn = uvicorn.Server(config)
        self._task = asyncio.create_task(self._uvicorn.serve())
        await await_for(lambda: self._uvicorn.started, 10, interval=0.005, what="uvicorn started")
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
        return self.server, self.client

    async def __aexit__(self, *exc):
        await self.client.aclose()
        self._uvicorn.should_exit = True
        await self._task


def parse_events(body: str) -> list:
    frames = [f for f in body.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    return [f[len("data: "):] for f in frames]


async def test_non_streaming_generate_shape():
    async with running() as (_, client):
        response = await client.post(
            "/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 4}, "rid": "abc"}
        )
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "abc"
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 2 and meta["completion_tokens"] == 4 and meta["cached_tokens"] == 0
    assert len(body["output_ids"]) == 4 and meta["e2e_latency"] >= 0


async def test_streaming_chunks_are_cumulative_and_end_with_done():
    async with running() as (_, client):
        response = await client.post(
            "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "stream": True},
        )
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 5
    for i, chunk in enumerate(chunks, start=1):
        assert len(chunk["output_ids"]) == i and chunk["meta_info"]["completion_tokens"] == i
        assert chunk["text"].startswith(chunks[0]["text"])
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert "e2e_latency" not in chunks[0]["meta_info"] and "e2e_latency" in chunks[-1]["meta_info"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(chunks[0]["meta_info"]["id"]) == 32  # generated uuid hex


@pytest.mark.parametrize(
    "sampling_params",
    [{"max_tokens": 5}, {"max_new_tokens": "5"}, {"temperature": "0.5"}, {"n": 2}, {"temperature": -1}],
)
async def test_strict_sampling_params_are_rejected(sampling_params):
    server, client = make_client()
    async with client:
        response = await client.post("/generate", json={"text": "hi", "sampling_params": sampling_params})
    assert response.status_code == 400
    assert isinstance(response.json()["error"]["message"], str)
    assert not server.engine.has_work


async def test_duplicate_running_rid_and_unknown_adapter_are_400():
    async with running(time_scale=1.0) as (server, client):
        first = asyncio.create_task(
            client.post("/generate", json={"text": "a", "rid": "same", "sampling_params": {"max_new_tokens": 50}})
        )
        await await_for(lambda: server.engine.get("same") is not None, 5, interval=0.005, what="the first one running")
        duplicate = await client.post("/generate", json={"text": "a", "rid": "same"})
        assert duplicate.status_code == 400 and "Duplicate request ID" in duplicate.json()["error"]["message"]
        unknown = await client.post("/generate", json={"text": "a", "lora_path": "ghost"})
        assert unknown.status_code == 400 and "never been loaded: ghost" in unknown.json()["error"]["message"]
        await client.post("/abort_request", json={"rid": "same"})
        assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_abort_mid_stream_ends_with_abort_finish_reason():
    async with running(time_scale=1.0) as (server, client):
        frames = []

        async def consume():
            async with client.stream(
                "POST", "/generate",
                json={"text": "x", "rid": "req-0001", "stream": True, "sampling_params": {"max_new_tokens": 1000}},
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        frames.append(line[len("data: "):])

        task = asyncio.create_task(consume())
        await await_for(lambda: len(frames) >= 3, 10, interval=0.01, what="three frames")
        response = await client.post("/abort_request", json={"rid": "req-"})
        assert response.status_code == 200 and response.content == b""
        await asyncio.wait_for(task, 5)
        assert frames[-1] == "[DONE]"
        last = json.loads(frames[-2])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= last["meta_info"]["completion_tokens"] < 1000
        assert not server.engine.has_work


async def test_client_disconnect_aborts_in_engine():
    async with running(time_scale=1.0) as (server, client):
        async with client.stream(
            "POST", "/generate",
            json={"text": "x", "rid": "gone", "stream": True, "sampling_params": {"max_new_tokens": 1000}},
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
        await await_for(lambda: server.engine.get("gone") is None, 1, interval=0.01, what="the request aborted")


async def test_loads_metrics_and_info_endpoints():
    async with running() as (_, client):
        for _ in range(2):
            await client.post("/generate", json={"text": "same prompt " * 80, "sampling_params": {"max_new_tokens": 3}})
        loads = (await client.get("/v1/loads", params={"include": "all"})).json()
        [load] = loads["loads"]
        assert load["dp_rank"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
        assert load["max_total_num_tokens"] == 418_701 and 0 <= load["token_usage"] <= 1
        assert load["cache_hit_rate"] > 0 and load["max_running_requests"] == 256
        assert {"num_used_tokens"} <= set(load)
        metrics = (await client.get("/metrics")).text
        for name in (
            "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
            "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
            "sglang:time_to_first_token_seconds_bucket", "sglang:inter_token_latency_seconds_bucket",
            "sglang:e2e_request_latency_seconds_count",
        ):
            assert name in metrics, name
        assert 'sglang:generation_tokens_total{model_name="meta-llama/Llama-3.3-70B-Instruct"} 6.0' in metrics
        info = (await client.get("/server_info")).json()
        assert info["inferbus_simulated"] is True and info["tp_size"] == 2 and info["page_size"] == 64
        assert info["enable_priority_scheduling"] is True  # workers leave in-engine room-making to it
        assert (await client.get("/model_info")).json()["is_generation"] is True
        assert (await client.get("/ready")).status_code == 200
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/flush_cache")).status_code == 200
        assert (await client.get("/v1/loads")).json()["loads"][0]["num_used_tokens"] == 0


async def test_lora_load_use_and_unload():
    async with running() as (_, client):
        bad = await client.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "missing/x"})
        assert bad.status_code == 400 and bad.json()["success"] is False and bad.json()["error_message"]
        ok = await client.post(
            "/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql", "pinned": True}
        )
        assert ok.json() == {"success": True, "error_message": None, "loaded_adapters": {"sql": "/adapters/sql"}}
        generated = await client.post(
            "/generate", json={"text": "select", "lora_path": "sql", "sampling_params": {"max_new_tokens": 2}}
        )
        assert generated.status_code == 200
        unloaded = await client.post("/unload_lora_adapter", json={"lora_name": "sql"})
        assert unloaded.json()["success"] is True and unloaded.json()["loaded_adapters"] == {}
        # As SGLang: an adapter loaded once since start is loaded again by a request naming it.
        after = await client.post(
            "/generate", json={"text": "select", "lora_path": "sql", "sampling_params": {"max_new_tokens": 2}}
        )
        assert after.status_code == 200


async def test_adapter_loads_run_one_at_a_time_as_in_sglang():
    async with running(time_scale=0.01, lora_load_time_s=1.0) as (server, client):
        first, second = await asyncio.gather(
            client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": "/adapters/a"}),
            client.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "/adapters/b"}))
        assert first.json()["success"] and second.json()["success"]
        ready = {name: adapter.ready_at for name, adapter in server.engine.adapters.items()}
        # The second load started when the first had answered: its weights are ready a load later.
        assert abs(ready["b"] - ready["a"]) >= 1.0


@pytest.mark.slow
async def test_many_concurrent_streams_at_zero_step_time():
    async with running(fixed_step_ms=0.0) as (server, client):

        async def one(i: int) -> int:
            response = await client.post(
                "/generate", json={"text": f"prompt {i}", "stream": True, "sampling_params": {"max_new_tokens": 20}}
            )
            events = parse_events(response.text)
            assert events[-1] == "[DONE]"
            return json.loads(events[-2])["meta_info"]["completion_tokens"]

        assert await asyncio.gather(*(one(i) for i in range(20))) == [20] * 20
        assert not server.engine.has_work


@pytest.mark.slow
async def test_the_time_scale_changes_while_running_only_with_its_control_on() -> None:
    """A benchmark runs an idle phase (adapter prefetching) faster in wall time: an adapter load of
    0.5 simulated seconds takes the wall time of the scale set."""
    load = {"lora_name": "a", "lora_path": "s3://a"}
    async with running(time_scale=1.0, lora_load_time_s=0.5) as (server, client):
        assert (await client.post("/time_scale", json={"time_scale": 0.1})).status_code in (404, 405)
        server.enable_time_scale_control()
        assert (await client.post("/time_scale", json={"time_scale": 0})).status_code == 400
        assert (await client.post("/time_scale", json={"time_scale": 0.1})).json() == {"time_scale": 0.1}
        assert (await client.get("/server_info")).json()["time_scale"] == 0.1
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await client.post("/load_lora_adapter", json=load)).json()["success"]
        assert loop.time() - started < 0.4  # 0.5 simulated seconds at 0.1 wall seconds each
        await client.post("/time_scale", json={"time_scale": 1.0})
        started = loop.time()
        await client.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": "s3://b"})
        assert loop.time() - started >= 0.45
