"""Prefill/decode disaggregation (SGLang's PD mode) against real SGLang 0.5.23 or the simulated
engine: one prefill and one decode engine, driven as SGLang's router drives them (the same
`/generate` body to both, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`).

Real SGLang runs the pair on CPU with its `mooncake_tcp` transfer backend (Mooncake's transfer
engine over TCP, no RDMA; `tests/sglang/install.sh` installs it) and
`--disaggregation-decode-retraction-backup cpu_tensor` (the default host pool needs CUDA to pin
memory); see docs/sglang-contract.md. The timeouts are shortened through SGLang's own environment
variables, which the simulated engine reads too. The last test kills the prefill engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from inferbus.local.ports import free_port

from .conftest import HERE, MAX_LORA_RANK, MAX_TOTAL_TOKENS, engine_kind, sglang_paths, sim_adapter, stop

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # two engines starting at once on 2 cores

START_TIMEOUT_S = 1500.0  # measured 390 s for both at load average 25, over 600 s at 35
WAITING_TIMEOUT_S = 8  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT: decode gives a transfer up after it
HEARTBEAT_INTERVAL_S = 2  # SGLang's floor
# SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT: a failed transfer's KV stays reserved on
# the decode side until the prefill acknowledges the ABORT, or this long (30 s by default).
DEFERRED_RELEASE_S = 20
TIMEOUTS = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DEFERRED_RELEASE_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL_S),
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
}
PROMPT = "def fibonacci(n):\n    # Return the n-th Fibonacci number, computed iteratively.\n"


@dataclass
class Role:
    name: str
    url: str
    kv_events: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.log.parent, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Pair:
    kind: str
    prefill: Role
    decode: Role
    bootstrap_port: int
    lora_path: str  # a LoRA adapter both engines can load

    def body(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "text": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.randrange(2**63),
        }
        body.update(fields)
        return body


def _commands(kind: str, role: str, port: int, bootstrap_port: int, kv_events: str,
              tmp: Path) -> tuple[list[str], dict[str, str]]:
    events = json.dumps({"publisher": "zmq", "endpoint": kv_events, "bind": True})
    pd = ["--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(bootstrap_port)]
    if role == "decode":  # SGLang's default backup pool registers host memory with CUDA
        pd += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if kind == "sglang":
        home, models = sglang_paths()
        argv = [
            str(home / "bin" / "python"), "-m", "sglang.launch_server",
            "--model-path", str(models / "model"), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--skip-server-warmup", "--kv-events-config", events,
            "--constrained-json-disable-any-whitespace",
            "--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(MAX_LORA_RANK),
            "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj",
            *pd, "--disaggregation-transfer-backend", "mooncake_tcp",
            "--nccl-port", str(free_port()),  # as conftest's sglang_command: from our own ports
        ]
        env = dict(os.environ)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(home / "cuda-stub"), env.get("LD_LIBRARY_PATH")]))
        env["PYTHONPATH"] = str(HERE / "site")
        env.pop("VIRTUAL_ENV", None)
    else:
        from inferbus.tokens.modeldir import build_model_dir

        model_dir = tmp / "model"
        if not model_dir.exists():
            build_model_dir(model_dir, "chatml", model_max_length=4096)
        argv = [
            sys.executable, "-m", "tools.commands.main", "sim-engine", "--host", "127.0.0.1", "--port", str(port),
            "--model-dir", str(model_dir), "--block-size", "1", "--kv-capacity-tokens", str(MAX_TOTAL_TOKENS),
            "--max-lora-rank", str(MAX_LORA_RANK), "--kv-events-config", events, *pd,
        ]
        env = dict(os.environ)
    env.update(TIMEOUTS)
    return argv, env


def _wait_healthy(role: Role, deadline: float) -> None:
    assert role.process is not None
    while time.monotonic() < deadline:
        if role.process.poll() is not None:
            raise RuntimeError(f"{role.name} engine exited with {role.process.returncode}:\n{role.tail()}")
        try:
            if httpx.get(role.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{role.name} engine not healthy in time:\n{role.tail()}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    kind = engine_kind()
    tmp = tmp_path_factory.mktemp(f"pd-{kind}")
    bootstrap_port = free_port()
    roles = []
    for name in ("prefill", "decode"):
        port, kv_events = free_port(), f"tcp://127.0.0.1:{free_port()}"
        argv, env = _commands(kind, name, port, bootstrap_port, kv_events, tmp)
        roles.append(Role(name, f"http://127.0.0.1:{port}", kv_events, argv, env, tmp / f"{name}.log"))
    try:
        for role in roles:
            role.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        for role in roles:
            _wait_healthy(role, deadline)
        if kind == "sglang":
            lora_path = str(sglang_paths()[1] / "lora")
        else:
            lora_path = sim_adapter(tmp / "lora", 4)
        yield Pair(kind, roles[0], roles[1], bootstrap_port, lora_path)
    finally:
        for role in roles:
            if role.process is not None:
                stop(role.process)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=120) as client:
        yield client


async def both(http: httpx.AsyncClient, pair: Pair, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """As SGLang's router: the same body to both engines at once."""
    return await asyncio.gather(http.post(pair.prefill.url + "/generate", json=body),
                                http.post(pair.decode.url + "/generate", json=body))


async def loads(http: httpx.AsyncClient, role: Role) -> dict[str, Any]:
    return (await http.get(role.url + "/v1/loads")).json()["loads"][0]  # type: ignore[no-any-return]


async def until(predicate, timeout: float = 60.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.1)
    return False


def events_of(frames: list[list[bytes]]) -> list[dict[str, Any]]:
    return [event for message in frames for event in msgspec.msgpack.decode(message[2])[1]]


async def test_the_bootstrap_server_tells_the_decode_side_where_the_prefill_is(pair: Pair, http: httpx.AsyncClient):
    bootstrap = f"http://127.0.0.1:{pair.bootstrap_port}"
    health = await http.get(bootstrap + "/health")
    assert health.status_code == 200 and health.text == "OK"
    layout = (await http.get(bootstrap + "/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                          "target_tp_rank": -1, "target_pp_rank": -1})).json()
    assert (layout["attn_tp_size"], layout["dp_size"], layout["pp_size"], layout["page_size"]) == (1, 1, 1, 1)
    assert layout["follow_bootstrap_room"] is True and layout["decode_allocation_policy"] == "early"
    assert layout["prefill_http_port"] == int(pair.prefill.url.rsplit(":", 1)[1])
    rank = (await http.get(bootstrap + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                        "target_tp_rank": 0, "target_pp_rank": 0})).json()
    assert set(rank) == {"rank_ip", "rank_port"}  # SGLang's is the machine's address, whatever --host is
    assert isinstance(rank["rank_ip"], str) and isinstance(rank["rank_port"], int)
    assert (await http.get(bootstrap + "/route")).status_code == 400  # a rank must be named


async def test_each_engine_reports_its_role(pair: Pair, http: httpx.AsyncClient):
    prefill = (await http.get(pair.prefill.url + "/server_info")).json()
    decode = (await http.get(pair.decode.url + "/server_info")).json()
    assert (prefill["disaggregation_mode"], decode["disaggregation_mode"]) == ("prefill", "decode")
    assert prefill["disaggregation_bootstrap_port"] == pair.bootstrap_port
    # SGLang turns the prefix cache off on a decode engine; the prefill keeps its own.
    assert prefill["disable_radix_cache"] is False and decode["disable_radix_cache"] is True
    assert decode["num_reserved_decode_tokens"] == 512
    assert decode["disaggregation_decode_retraction_backup"] == "cpu_tensor"
    assert (await http.get(pair.decode.url + "/model_info")).json()["disaggregation_mode"] == "decode"
    assert (await loads(http, pair.decode))["disaggregation"]["mode"] == "decode"
    assert (await loads(http, pair.prefill))["disaggregation"]["mode"] == "prefill"


async def test_a_request_through_the_pair(pair: Pair, http: httpx.AsyncClient):
    prefill, decode = await both(http, pair, pair.body(rid="pd-one"))
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    p, d = prefill.json(), decode.json()
    # The prefill computes the prompt and one token, and answers once its KV has been sent.
    assert p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert p["output_ids"] == d["output_ids"][:1]
    # The decode engine's answer is the request's: the prefill's token, then its own.
    assert d["meta_info"]["finish_reason"]["type"] == "length" and d["meta_info"]["completion_tokens"] == 6
    assert len(d["output_ids"]) == 6
    assert d["meta_info"]["prompt_tokens"] == p["meta_info"]["prompt_tokens"]

    # Again: the prefill's prefix cache hits, and the decode engine reports the prefill's count.
    prefill, decode = await both(http, pair, pair.body(rid="pd-two"))
    cached = prefill.json()["meta_info"]["cached_tokens"]
    assert cached > 0
    assert decode.json()["meta_info"]["cached_tokens"] == cached
    assert decode.json()["output_ids"] == d["output_ids"]  # greedy: the same answer


async def test_a_streamed_request_through_the_pair(pair: Pair, http: httpx.AsyncClient):
    prefill, decode = await both(http, pair, pair.body(rid="pd-stream", stream=True))
    p_events = [f[len("data: "):] for f in prefill.text.split("\n\n") if f]
    d_events = [f[len("data: "):] for f in decode.text.split("\n\n") if f]
    assert p_events[-1] == d_events[-1] == "[DONE]"
    last_p = json.loads(p_events[-2])
    chunks = [json.loads(e) for e in d_events[:-1]]
    assert last_p["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert chunks[0]["output_ids"][:1] == last_p["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(chunks[-1]["output_ids"]) == 6


async def test_an_adapter_loaded_on_both_engines_serves_through_the_pair(pair: Pair, http: httpx.AsyncClient):
    for role in (pair.prefill, pair.decode):
        loaded = await http.post(
            role.url + "/load_lora_adapter", json={"lora_name": "pd-lora", "lora_path": pair.lora_path}
        )
        assert loaded.status_code == 200, loaded.text
    base = (await both(http, pair, pair.body(rid="pd-base")))[1].json()
    prefill, decode = await both(http, pair, pair.body(rid="pd-adapter", lora_path="pd-lora"))
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert prefill.json()["output_ids"] == decode.json()["output_ids"][:1]
    assert decode.json()["output_ids"] != base["output_ids"]  # the adapter's weights, on both engines


async def test_a_request_naming_the_fake_bootstrap_host_runs_on_one_engine(pair: Pair, http: httpx.AsyncClient):
    """SGLang's warm-up and health checks name its fake bootstrap host: no peer, no transfer."""
    fake = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
    prefill = await http.post(pair.prefill.url + "/generate", json=pair.body(rid="pd-fake-p", **fake))
    assert prefill.status_code == 200, prefill.text
    assert prefill.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert prefill.json()["meta_info"]["completion_tokens"] == 1
    decode = await http.post(pair.decode.url + "/generate", json=pair.body(rid="pd-fake-d", **fake))
    assert decode.status_code == 200, decode.text
    assert decode.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_a_chat_completion_through_the_pair(pair: Pair, http: httpx.AsyncClient):
    """SGLang's OpenAI endpoints take the same PD routing fields (its router forwards them so)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pair.bootstrap_port, "bootstrap_room": random.randrange(2**63)}
    prefill, decode = await asyncio.gather(http.post(pair.prefill.url + "/v1/chat/completions", json=body),
                                           http.post(pair.decode.url + "/v1/chat/completions", json=body))
    assert prefill.status_code == decode.status_code == 200, (prefill.text, decode.text)
    assert prefill.json()["usage"]["completion_tokens"] == 1
    assert decode.json()["usage"]["completion_tokens"] == 5
    assert decode.json()["usage"]["prompt_tokens"] == prefill.json()["usage"]["prompt_tokens"]


async def test_a_request_without_a_room_is_refused(pair: Pair, http: httpx.AsyncClient):
    prefill, _ = await both(http, pair, pair.body(rid="pd-counted"))
    prompt_tokens = prefill.json()["meta_info"]["prompt_tokens"]
    for role in (pair.prefill, pair.decode):
        rid = f"no-room-{role.name}"
        message = f"Invalid request: Disaggregated request received without bootstrap room id. req.rid='{rid}'"
        response = await http.post(role.url + "/generate", json={"text": PROMPT, "rid": rid})
        assert response.status_code == 400 and response.json()["error"]["message"] == message
        # Streamed: the scheduler's abort, in-band, with the status.
        streamed = await http.post(role.url + "/generate", json={"text": PROMPT, "rid": rid + "-s", "stream": True})
        events = [f[len("data: "):] for f in streamed.text.split("\n\n") if f]
        assert streamed.status_code == 200 and events[-1] == "[DONE]" and len(events) == 2
        meta = json.loads(events[0])["meta_info"]
        assert meta["finish_reason"] == {
            "type": "abort",
            "message": message.replace(rid, rid + "-s"),
            "status_code": 400,
            "err_type": None,
        }
        assert meta["prompt_tokens"] == prompt_tokens and meta["completion_tokens"] == 0


async def test_a_decode_abort_fails_the_prefill_waiting_for_it(pair: Pair, http: httpx.AsyncClient):
    # A prompt the decode engine cannot reserve KV for while it holds back its 512 decode tokens
    # (3,600 + 512 > 4,096), so it waits in its prealloc queue and the prefill in its bootstrap queue.
    ids = [random.randrange(3, 2000) for _ in range(3600)]
    body = pair.body(input_ids=ids, rid="pd-decode-abort")
    body.pop("text")
    room = body["bootstrap_room"]
    requests = asyncio.ensure_future(both(http, pair, body))

    async def both_waiting() -> bool:
        p, d = await loads(http, pair.prefill), await loads(http, pair.decode)
        return bool(p["disaggregation"]["prefill_bootstrap_queue_reqs"] == 1
                    and d["disaggregation"]["decode_prealloc_queue_reqs"] == 1)

    assert await until(both_waiting), "the pair never waited for the decode engine's KV"
    # SGLang counts both queues as waiting requests.
    assert (
        (await loads(http, pair.prefill))["num_waiting_reqs"]
        == (await loads(http, pair.decode))["num_waiting_reqs"]
        == 1
    )
    await http.post(pair.decode.url + "/abort_request", json={"rid": "pd-decode-abort"})
    prefill, decode = await asyncio.wait_for(requests, 60)
    assert decode.status_code == 500 and decode.json()["message"] == (
        f"Decode handshake failed for request rank=0 decode_req.req.rid='pd-decode-abort' "
        f"decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): "
        f"Aborted by AbortReq.")
    # The decode engine told the prefill rank, which records no reason of its own for it.
    assert prefill.status_code == 500 and prefill.json()["message"] == (
        f"Prefill bootstrap failed for request rank=0 req.rid='pd-decode-abort' req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): Failed due to an unknown reason from another rank")
    assert await until(lambda: _idle(http, pair)), "a side still holds the aborted request"


async def _idle(http: httpx.AsyncClient, pair: Pair) -> bool:
    p, d = await loads(http, pair.prefill), await loads(http, pair.decode)
    return all(load["num_running_reqs"] == load["num_waiting_reqs"] == 0 for load in (p, d))


async def test_a_prefill_abort_is_not_told_to_the_decode_side(pair: Pair, http: httpx.AsyncClient):
    body = pair.body(rid="pd-prefill-abort")
    room = body["bootstrap_room"]
    # The prefill request waits for its decode side; aborted there, it fails at once...
    alone = asyncio.ensure_future(http.post(pair.prefill.url + "/generate", json=body))
    assert await until(lambda: _bootstrapping(http, pair)), "the prefill never waited for its decode side"
    await http.post(pair.prefill.url + "/abort_request", json={"rid": "pd-prefill-abort"})
    prefill = await asyncio.wait_for(alone, 60)
    assert prefill.status_code == 500 and prefill.json()["message"] == (
        f"Prefill bootstrap failed for request rank=0 req.rid='pd-prefill-abort' req.bootstrap_room={room} "
        f"with exception KVTransferError(bootstrap_room={room}): Aborted by AbortReq.")
    # ... while the decode side, which SGLang does not tell, reserves KV, says where it goes and
    # waits SGLANG_DISAGGREGATION_WAITING_TIMEOUT for KV that never comes.
    started = time.monotonic()
    decode = await asyncio.wait_for(http.post(pair.decode.url + "/generate", json=body), 120)
    assert time.monotonic() - started >= WAITING_TIMEOUT_S * 0.9
    message = decode.json()["message"]
    assert decode.status_code == 500
    assert message.startswith(f"Decode transfer failed for request rank=0 decode_req.req.rid='pd-prefill-abort' "
                              f"decode_req.req.bootstrap_room={room} with exception")
    assert message.endswith("in KVPoll.WaitingForInput") and f"Request {room} timed out after" in message


async def _bootstrapping(http: httpx.AsyncClient, pair: Pair) -> bool:
    return bool((await loads(http, pair.prefill))["disaggregation"]["prefill_bootstrap_queue_reqs"] == 1)


async def test_kv_events_come_from_the_prefill_engine_only(pair: Pair, http: httpx.AsyncClient):
    context = zmq.asyncio.Context()
    subscribers = {}
    for role in (pair.prefill, pair.decode):
        sock = context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(role.kv_events)
        subscribers[role.name] = sock
    received: dict[str, list[list[bytes]]] = {"prefill": [], "decode": []}

    async def drain() -> None:
        for name, sock in subscribers.items():
            while await sock.poll(0):
                received[name].append(await sock.recv_multipart())

    try:
        await asyncio.sleep(1.0)  # SUB sockets join late: let them connect before the request
        unique = f"# {random.randrange(10**9)} a prompt this engine has not seen\n" + PROMPT
        prefill, decode = await both(http, pair, pair.body(text=unique, rid="pd-events"))
        assert prefill.status_code == decode.status_code == 200

        async def prefill_published() -> bool:
            await drain()
            return any(e.get("type") == "BlockStored" for e in events_of(received["prefill"]))

        assert await until(prefill_published, 30), "the prefill engine published no BlockStored"
        await asyncio.sleep(1.0)
        await drain()
        stored = [e for e in events_of(received["prefill"]) if e.get("type") == "BlockStored"]
        tokens = [t for e in stored for t in e["token_ids"]]
        assert len(tokens) >= prefill.json()["meta_info"]["prompt_tokens"] - 1  # the prompt's KV, page size 1
        assert [e for e in events_of(received["decode"]) if e.get("type") == "BlockStored"] == []
    finally:
        for sock in subscribers.values():
            sock.close(linger=0)
        context.term()


async def _transferring(http: httpx.AsyncClient, pair: Pair) -> bool:
    load = await loads(http, pair.decode)
    return bool(load["disaggregation"]["decode_transfer_queue_reqs"] == 1)


async def test_a_decode_abort_while_its_kv_is_awaited(pair: Pair, http: httpx.AsyncClient):
    body = pair.body(rid="pd-late-abort")
    room = body["bootstrap_room"]
    # Only the decode side gets the request: it reserves KV, says where it goes, and waits.
    waiting = asyncio.ensure_future(http.post(pair.decode.url + "/generate", json=body))
    assert await until(lambda: _transferring(http, pair)), "the decode engine never waited for the KV"
    load = await loads(http, pair.decode)
    assert load["num_used_tokens"] >= 1 and load["num_waiting_reqs"] == 1  # the reservation, the transfer queue
    await http.post(pair.decode.url + "/abort_request", json={"rid": "pd-late-abort"})
    response = await asyncio.wait_for(waiting, 60)
    assert response.status_code == 500 and response.json()["message"] == (
        f"Decode transfer failed for request rank=0 decode_req.req.rid='pd-late-abort' decode_req.req.bootstrap_room="
        f"{room} with exception KVTransferError(bootstrap_room={room}): Aborted by AbortReq.")
    assert await until(lambda: _idle(http, pair)), "the decode engine still holds the aborted request"
    # The reservation outlives the request until the prefill acknowledges the ABORT (SGLang's
    # deferred release), which it does at once here: well before the release timeout.
    assert await until(lambda: _kv_free(http, pair), DEFERRED_RELEASE_S / 2), "the reservation was not freed"


async def _kv_free(http: httpx.AsyncClient, pair: Pair) -> bool:
    return bool((await loads(http, pair.decode))["num_used_tokens"] == 0)


async def test_a_dead_prefill_fails_the_decode_sides_requests(pair: Pair, http: httpx.AsyncClient):
    """Last: it kills the prefill engine."""
    body = pair.body(rid="pd-orphan")
    room = body["bootstrap_room"]
    # Only the decode side gets the request: it reserves KV, says where it goes, and waits.
    waiting = asyncio.ensure_future(http.post(pair.decode.url + "/generate", json=body))
    assert await until(lambda: _transferring(http, pair)), "the decode engine never waited for the KV"
    assert pair.prefill.process is not None
    os.killpg(pair.prefill.process.pid, signal.SIGKILL)
    pair.prefill.process.wait()
    response = await asyncio.wait_for(waiting, 60)
    assert response.status_code == 500
    assert response.json()["message"] == (
        f"Decode transfer failed for request rank=0 decode_req.req.rid='pd-orphan' decode_req.req.bootstrap_room="
        f"{room} with exception KVTransferError(bootstrap_room={room}): Lost connection with prefill instance "
        f"(bootstrap_addr: 127.0.0.1:{pair.bootstrap_port})")
    # No prefill is left to acknowledge the ABORT: the KV it might have been writing stays reserved
    # until the deferred-release timeout, then is freed anyway.
    failed = time.monotonic()
    assert (await loads(http, pair.decode))["num_used_tokens"] > 0
    assert await until(lambda: _kv_free(http, pair), DEFERRED_RELEASE_S * 2), "the held KV was never freed"
    assert time.monotonic() - failed >= DEFERRED_RELEASE_S / 2
