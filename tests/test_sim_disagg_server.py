"""A simulated prefill/decode pair over real sockets: the bootstrap server, the ZMQ channel between
the two engines, and what clients see (docs/sim-engine.md, "Prefill/decode disaggregation")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from inferbus.local.ports import free_port
from services.sim_engine.app import build_server
from services.sim_engine.config import EngineConfig

from .test_sim_server import parse_events
from .waiting import await_for

pytestmark = pytest.mark.slow

FAST = {"time_scale": 0.0, "fixed_step_ms": 10.0, "lora_load_time_s": 0.0, "kv_capacity_tokens": 8192,
        "block_size": 16, "answer_length_median": 0}


class served:
    """An engine (a DisaggEngineServer for a PD role) under uvicorn on a free port."""

    def __init__(self, **settings: Any) -> None:
        config = EngineConfig(**{**FAST, "port": free_port(), **settings})
        self.server = build_server(config)
        self.port = config.port

    async def start(self) -> served:
        # A failing test leaves requests open: do not wait for them at shutdown.
        config = uvicorn.Config(
            self.server.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self._uvicorn = uvicorn.Server(config)
        self._task = asyncio.create_task(self._uvicorn.serve())
        await await_for(lambda: self._uvicorn.started, 10, interval=0.005, what="uvicorn started")
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        return self

    async def stop(self) -> None:
        await self.client.aclose()
        self._uvicorn.should_exit = True
        await self._task

    @contextlib.asynccontextmanager
    async def start_context(self) -> AsyncIterator[served]:
        await self.start()
        try:
            yield self
        finally:
            await self.stop()


class pair:
    """A prefill and a decode engine that know each other only through the bootstrap trio."""

    def __init__(self, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None) -> None:
        self.bootstrap_port = free_port()
        self.prefill = served(disaggregation_mode="prefill", disaggregation_bootstrap_port=self.bootstrap_port,
                              **(prefill or {}))
        self.decode = served(disaggregation_mode="decode", **(decode or {}))

    async def __aenter__(self) -> pair:
        await self.prefill.start()
        await self.decode.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.decode.stop()
        if not self.prefill._task.done():
            await self.prefill.stop()

    def body(self, **fields: Any) -> dict[str, Any]:
        body = {"text": "The quick brown fox " * 20, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": random.randrange(2**63)}
        body.update(fields)
        return body

    async def generate(self, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
        """As SGLang's router: the same body to both at once."""
        return await asyncio.gather(self.prefill.client.post("/generate", json=body),
                                    self.decode.client.post("/generate", json=body))

    async def loads(self, role: served) -> dict[str, Any]:
        return (await role.client.get("/v1/loads")).json()["loads"][0]


async def test_a_pair_answers_as_one_engine_would_and_reports_the_prefills_cache():
    async with pair() as pd:
        alone = await served().start()
        try:
            body = pd.body(rid="one")
            expected = (await alone.client.post("/generate", json={"text": body["text"],
                                                                   "sampling_params": body["sampling_params"]})).json()
        finally:
            await alone.stop()
        prefill, decode = await pd.generate(body)
        assert prefill.status_code == decode.status_code == 200
        p, d = prefill.json(), decode.json()
        assert d["text"] == expected["text"] and d["output_ids"] == expected["output_ids"]
        assert p["output_ids"] == d["output_ids"][:1]  # the decode engine's first token is the prefill's
        assert p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}  # SGLang's, for a prefill
        assert p["meta_info"]["completion_tokens"] == 1
        assert d["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert (
            d["meta_info"]["prompt_tokens"] == p["meta_info"]["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
        )
        assert d["meta_info"]["completion_tokens"] == 6

        # The same prompt again: the prefill's cache hits, and the decode engine reports them.
        prefill, decode = await pd.generate(pd.body(rid="two"))
        cached = prefill.json()["meta_info"]["cached_tokens"]
        assert cached > 0 and decode.json()["meta_info"]["cached_tokens"] == cached
        # The decode engine keeps no prefix cache (SGLang disables it there); the prefill's holds the prompt.
        assert pd.decode.server.engine.cache.cached_tokens == 0
        assert pd.prefill.server.engine.cache.cached_tokens >= cached
        assert pd.decode.server.engine.cache.used_tokens == 0  # every reservation released


async def test_streams_first_token_from_the_prefill_then_decode_steps():
    async with pair() as pd:
        body = pd.body(stream=True, rid="s")
        prefill, decode = await pd.generate(body)
        p_events, d_events = parse_events(prefill.text), parse_events(decode.text)
        assert p_events[-1] == d_events[-1] == "[DONE]"
        assert len(p_events) == 2  # one answer, once the KV has landed
        first = json.loads(p_events[0])
        chunks = [json.loads(e) for e in d_events[:-1]]
        assert chunks[0]["output_ids"] == first["output_ids"]
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 7))


async def test_a_request_without_a_room_is_refused_as_sglang():
    async with pair() as pd:
        for role in (pd.prefill, pd.decode):
            plain = await role.client.post("/generate", json={"text": "hi", "rid": "x"})
            assert plain.status_code == 400
            assert plain.json()["error"]["message"] == (
                "Invalid request: Disaggregated request received without bootstrap room id. req.rid='x'")
            streamed = await role.client.post("/generate", json={"text": "hi", "rid": "y", "stream": True})
            event = json.loads(parse_events(streamed.text)[0])
            assert event["meta_info"]["finish_reason"]["status_code"] == 400
            # The OpenAI-compatible endpoints take no bootstrap trio: refused the same way.
            completion = await role.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert completion.status_code == 400
            assert "without bootstrap room id" in completion.json()["error"]["message"]
        # Health checks go through (SGLang sends them with its fake bootstrap host).
        assert (await pd.prefill.client.get("/health")).status_code == 200
        assert (await pd.decode.client.get("/health")).status_code == 200


async def test_bootstrap_server_and_server_info():
    async with pair() as pd:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{pd.bootstrap_port}") as bootstrap:
            assert (await bootstrap.get("/health")).text == "OK"
            layout = (await bootstrap.get("/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                            "target_tp_rank": -1, "target_pp_rank": -1})).json()
            assert layout["page_size"] == 16 and layout["dp_size"] == 1
            assert layout["prefill_http_port"] == pd.prefill.port
            rank = (await bootstrap.get("/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                          "target_tp_rank": 0, "target_pp_rank": 0})).json()
            assert set(rank) == {"rank_ip", "rank_port"}
            assert (await bootstrap.get("/route")).status_code == 400
        p_info = (await pd.prefill.client.get("/server_info")).json()
        d_info = (await pd.decode.client.get("/server_info")).json()
        assert p_info["disaggregation_mode"] == "prefill" and d_info["disaggregation_mode"] == "decode"
        assert p_info["disaggregation_bootstrap_port"] == pd.bootstrap_port
        assert p_info["disable_radix_cache"] is False and d_info["disable_radix_cache"] is True
        assert d_info["disaggregation_transfer_backend"] == "mooncake"
        assert (await pd.decode.client.get("/model_info")).json()["disaggregation_mode"] == "decode"


async def test_the_kv_transfer_takes_the_links_time():
    # 81 prompt tokens × 163,840 B at 1 MB/s per GPU over 2 GPUs: 6.6 simulated seconds, 0.33 s of
    # wall time at a time scale of 0.05. Steps take no time.
    slow = {"kv_transfer_bandwidth_gb_s": 0.001, "time_scale": 0.05, "fixed_step_ms": 0.0}
    async with pair(prefill=slow) as pd:
        body = pd.body()
        started = time.monotonic()
        prefill, decode = await pd.generate(body)
        elapsed = time.monotonic() - started
        tokens = prefill.json()["meta_info"]["prompt_tokens"]
        link_s = pd.prefill.server.prefill_rooms.link.link.transfer_s(tokens, 2, 2)
        assert link_s == pytest.approx(tokens * 163_840 / (2 * 1e6))
        assert elapsed >= link_s * 0.05
        section = (await pd.loads(pd.prefill))["disaggregation"]
        assert section["kv_transfer_latency_ms"] == pytest.approx(link_s * 1000, rel=0.01)
        assert section["kv_transfer_speed_gb_s"] == pytest.approx(tokens * 163_840 / link_s / 1e9, rel=0.01)
        metrics = (await pd.prefill.client.get("/metrics")).text
        assert 'sglang:kv_transfer_latency_ms_count{model_name="meta-llama/Llama-3.3-70B-Instruct"} 1.0' in metrics


SLOW_PREFILL = {"fixed_step_ms": 100.0, "time_scale": 1.0, "chunked_prefill_size": 2}  # ~4 s for an 81-token prompt


async def test_decode_abort_fails_both_sides_with_sglangs_messages():
    async with pair(prefill=SLOW_PREFILL) as pd:
        body = pd.body(rid="cancel-me")
        both = asyncio.ensure_future(pd.generate(body))
        await await_for(lambda: _prefilling(pd), 10, what="KV reserved and the prompt prefilling")
        await pd.decode.client.post("/abort_request", json={"rid": "cancel-me"})
        prefill, decode = await both
        room = body["bootstrap_room"]
        assert decode.status_code == 500 and decode.json()["message"] == (
            f"Decode transfer failed for request rank=0 decode_req.req.rid='cancel-me' decode_req.req.bootstrap_room="
            f"{room} with exception KVTransferError(bootstrap_room={room}): Aborted by AbortReq.")
        assert prefill.status_code == 500 and prefill.json()["message"] == (
            f"Prefill transfer failed for request rank=0 req.rid='cancel-me' req.bootstrap_room={room} with exception "
            f"KVTransferError(bootstrap_room={room}): Failed due to an unknown reason from another rank")
        assert not pd.prefill.server.engine.has_work  # the prefill stopped computing
        # The reservation is freed once the prefill acknowledges the ABORT, long before the 30 s
        # SGLang waits for an acknowledgement that never comes.
        await await_for(lambda: pd.decode.server.engine.cache.used_tokens == 0, 5, what="the reservation freed")


async def _section(pd: pair, role: served, key: str) -> int:
    return int((await pd.loads(role))["disaggregation"][key])


async def _prefilling(pd: pair) -> bool:
    """Both sides past the handshake: the decode engine reserved the KV and the prefill engine, told
    so, computes the prompt. The decode side gets there first: on a busy machine an abort sent when
    only it had would find the prefill still bootstrapping (SGLang's "Prefill bootstrap failed")."""
    prefill = await pd.loads(pd.prefill)
    return (await _section(pd, pd.decode, "decode_transfer_queue_reqs") >= 1
            and int(prefill["disaggregation"]["prefill_bootstrap_queue_reqs"]) == 0
            and prefill["num_running_reqs"] + prefill["num_waiting_reqs"] >= 1)


async def test_prefill_abort_is_not_told_to_the_decode_side_which_times_out(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "1")
    async with pair(prefill=SLOW_PREFILL) as pd:
        body = pd.body(rid="p", stream=True)
        both = asyncio.ensure_future(pd.generate(body))
        await await_for(lambda: _prefilling(pd), 10, what="KV reserved and the prompt prefilling")
        started = time.monotonic()
        await pd.prefill.client.post("/abort_request", json={"rid": "p"})
        prefill, decode = await both
        waited = time.monotonic() - started
        p_finish = json.loads(parse_events(prefill.text)[-2])["meta_info"]["finish_reason"]
        assert p_finish["type"] == "abort" and p_finish.get("status_code") is None  # prefilling: an ordinary abort
        d_finish = json.loads(parse_events(decode.text)[-2])["meta_info"]["finish_reason"]
        assert d_finish["status_code"] == 500
        assert "timed out after" in d_finish["message"] and "in KVPoll.WaitingForInput" in d_finish["message"]
        assert waited >= 0.9  # the decode engine learned nothing from the prefill; its own timeout ended it


async def test_prefill_abort_while_waiting_for_its_decode_side():
    async with pair() as pd:
        body = pd.body(rid="lonely")
        alone = asyncio.ensure_future(pd.prefill.client.post("/generate", json=body))
        await await_for(lambda: _section(pd, pd.prefill, "prefill_bootstrap_queue_reqs"), 10, what="bootstrapping")
        assert (await pd.loads(pd.prefill))["num_waiting_reqs"] == 1
        metrics = (await pd.prefill.client.get("/metrics")).text
        assert 'sglang:num_prefill_bootstrap_queue_reqs{model_name="meta-llama/Llama-3.3-70B-Instruct"} 1.0' in metrics
        await pd.prefill.client.post("/abort_request", json={"rid": "lonely"})
        response = await alone
        assert response.status_code == 500
        assert response.json()["message"].startswith("Prefill bootstrap failed for request rank=0 req.rid='lonely'")
        assert response.json()["message"].endswith("Aborted by AbortReq.")


async def test_prefill_bootstrap_timeout(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "1")
    async with pair() as pd:
        response = await pd.prefill.client.post("/generate", json=pd.body(rid="nobody-decodes"))
        assert response.status_code == 500
        assert (
            "timed out after" in response.json()["message"] and "in KVPoll.Bootstrapping" in response.json()["message"]
        )


async def test_a_dead_prefill_fails_the_decode_sides_requests(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "1")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "1.5")
    async with pair() as pd:
        # Only the decode side gets the request: it handshakes, reserves KV and waits for the KV.
        body = pd.body(rid="orphan")
        waiting = asyncio.ensure_future(pd.decode.client.post("/generate", json=body))
        await await_for(lambda: _section(pd, pd.decode, "decode_transfer_queue_reqs"), 10, what="KV reserved")
        await pd.prefill.stop()  # its bootstrap server goes with it
        response = await asyncio.wait_for(waiting, 20)
        assert response.status_code == 500
        assert response.json()["message"].endswith(
            f"Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:{pd.bootstrap_port})")
        # No prefill to acknowledge the ABORT: the KV it might have been writing stays reserved
        # until SGLang's deferred-release timeout, then is freed anyway.
        failed = time.monotonic()
        assert pd.decode.server.engine.cache.used_tokens > 0
        assert (await pd.loads(pd.decode))["num_used_tokens"] > 0
        await await_for(lambda: pd.decode.server.engine.cache.used_tokens == 0, 5, what="the held KV freed")
        assert time.monotonic() - failed >= 1.0


async def test_without_the_deferred_release_a_failed_transfers_kv_is_freed_at_once(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "2")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "1")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "false")
    async with pair() as pd:
        waiting = asyncio.ensure_future(pd.decode.client.post("/generate", json=pd.body(rid="orphan")))
        await await_for(lambda: _section(pd, pd.decode, "decode_transfer_queue_reqs"), 10, what="KV reserved")
        await pd.prefill.stop()
        assert (await asyncio.wait_for(waiting, 20)).status_code == 500
        assert pd.decode.server.engine.cache.used_tokens == 0


async def test_an_unreachable_prefill_fails_the_handshake(monkeypatch):
    monkeypatch.setattr("services.sim_engine.disagg_server.HANDSHAKE_RETRY_S", 0.01)
    async with served(disaggregation_mode="decode").start_context() as decode:
        body = {"text": "hi", "rid": "h", "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(),
                "bootstrap_room": 5}
        response = await decode.client.post("/generate", json=body)
        assert response.status_code == 500
        assert response.json()["message"] == (
            "Decode handshake failed for request rank=0 decode_req.req.rid='h' decode_req.req.bootstrap_room=5 "
            "with exception KVTransferError(bootstrap_room=5): Aborted by AbortReq.")


async def test_decode_waits_for_kv_room_then_takes_the_next_transfer():
    # 1,024 tokens of KV, 200 held back per request: a 321-token prompt needs 521, so the second
    # waits while the first runs (1,024 - 321 - 200 held for it < 521), then goes.
    tight = {"kv_capacity_tokens": 1024, "num_reserved_decode_tokens": 200, "fixed_step_ms": 20.0, "time_scale": 1.0}
    async with pair(decode=tight) as pd:
        long = "The quick brown fox " * 80  # 321 tokens with the stand-in tokenizer
        first = pd.generate(pd.body(rid="a", text=long, sampling_params={"max_new_tokens": 60, "temperature": 0}))
        running = asyncio.ensure_future(first)
        await await_for(lambda: _loads_are(pd, running=1), 10, what="the first request decoding")
        second = asyncio.ensure_future(pd.generate(pd.body(rid="b", text=long)))
        await await_for(lambda: _section(pd, pd.decode, "decode_prealloc_queue_reqs"), 10, what="the second waiting")
        load = await pd.loads(pd.decode)
        assert load["disaggregation"]["decode_transfer_queue_reqs"] == 0 and load["num_waiting_reqs"] == 1
        assert load["num_used_tokens"] >= 321
        assert not second.done()
        for prefill, decode in (await running, await second):
            assert prefill.status_code == decode.status_code == 200
        assert pd.decode.server.engine.cache.used_tokens == 0


async def _loads_are(pd: pair, running: int) -> bool:
    return bool((await pd.loads(pd.decode))["num_running_reqs"] == running)


async def test_fake_backend_decodes_without_a_prefill():
    async with served(disaggregation_mode="decode", disaggregation_transfer_backend="fake").start_context() as decode:
        response = await decode.client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
        assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 3


async def test_a_decode_engine_with_its_own_cache_is_sent_only_what_it_lacks():
    async with pair(decode={"disaggregation_decode_enable_radix_cache": True}) as pd:
        first = await pd.generate(pd.body(rid="a"))
        whole = pd.prefill.server.prefill_rooms.last_transfer
        assert pd.decode.server.engine.cache.cached_tokens > 0  # it caches (and publishes) prompt and output
        second = await pd.generate(pd.body(rid="b"))
        part = pd.prefill.server.prefill_rooms.last_transfer
        prompt = first[0].json()["meta_info"]["prompt_tokens"]
        assert whole is not None and part is not None
        assert whole[1] == prompt * 163_840
        # The decode engine held the prompt's full 16-token blocks but the last: only the rest came.
        held = (prompt - 1) // 16 * 16
        assert part[1] == (prompt - held) * 163_840
        assert second[1].json()["output_ids"] == first[1].json()["output_ids"]
        assert pd.decode.server.engine.cache.used_tokens == pd.decode.server.engine.cache.cached_tokens


async def test_a_request_naming_sglangs_fake_bootstrap_host_runs_alone_on_either_role():
    async with pair() as pd:
        fake = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}  # what SGLang's warm-up sends
        for role, tokens in ((pd.prefill, 1), (pd.decode, 6)):
            answers = await asyncio.gather(*(role.client.post("/generate", json=pd.body(rid=f"{role.port}-{i}", **fake))
                                             for i in range(2)))  # the same room twice at once
            for answer in answers:
                assert answer.status_code == 200, answer.text
                meta = answer.json()["meta_info"]
                assert meta["completion_tokens"] == tokens
                assert meta["finish_reason"]["length"] == (0 if role is pd.prefill else 6)
        assert (await pd.loads(pd.prefill))["disaggregation"]["kv_transfer_latency_ms"] == 0.0  # nothing moved
        assert pd.prefill.server.prefill_rooms.link.free_at == 0.0  # not even queued on the link


async def test_openai_endpoints_take_the_bootstrap_trio_as_sglangs_do():
    async with pair() as pd:
        body = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 5, "temperature": 0,
                "bootstrap_host": "127.0.0.1", "bootstrap_port": pd.bootstrap_port,
                "bootstrap_room": random.randrange(2**63)}
        prefill, decode = await asyncio.gather(pd.prefill.client.post("/v1/chat/completions", json=body),
                                               pd.decode.client.post("/v1/chat/completions", json=body))
        assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
        first = prefill.json()["choices"][0]["message"]["content"]
        answer = decode.json()["choices"][0]["message"]["content"]
        assert first and answer.startswith(first)
        assert prefill.json()["usage"]["completion_tokens"] == 1 and decode.json()["usage"]["completion_tokens"] == 5
        bad = await pd.decode.client.post("/v1/completions", json={"prompt": "hi", "bootstrap_room": [1, 2]})
        assert bad.status_code == 400
