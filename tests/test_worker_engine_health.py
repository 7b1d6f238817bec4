"""The worker's view of its engine: down and back with backoff, slots from /server_info, adapters
an engine lost in a restart."""

import pytest

from proto import messages as m
from services.worker.adapters import Adapters
from services.worker.engine import EngineError, EngineUpdate, _http_error
from services.worker.engine_health import EngineHealth
from services.worker.service import engine_max_running
from services.worker.serving import engine_stream


def test_probes_back_off_exponentially_and_recovery_says_the_engine_was_down() -> None:
    now = [0.0]
    health = EngineHealth(lambda: now[0], first_delay_s=0.1, max_delay_s=2.0)
    assert health.up and not health.recovered()
    delays = [health.failed() for _ in range(7)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert not health.up and health.down_since == 0.0 and health.failures == 7
    assert health.recovered() and health.up and health.failures == 0
    assert health.failed() == 0.1  # a new outage starts from the first delay again


def test_max_running_comes_from_internal_states_when_the_flag_was_not_given() -> None:
    # SGLang 0.5.23 without --max-running-requests: null at the top, the effective value per DP rank.
    info = {"max_running_requests": None, "dp_size": 1,
            "internal_states": [{"effective_max_running_requests_per_dp": 2048}]}
    assert engine_max_running(info) == 2048
    assert engine_max_running({**info, "dp_size": 2}) == 4096
    assert engine_max_running({**info, "max_running_requests": 8}) == 8
    with pytest.raises(EngineError):
        engine_max_running({"max_running_requests": None})


def test_sglangs_never_loaded_adapter_error_is_told_apart() -> None:
    lost = _http_error(400, b'{"error": {"message": "Got LoRA adapter that has never been loaded: sql@0123456789ab"}}')
    assert lost.code == "adapter_not_loaded" and not lost.retryable
    assert _http_error(400, b'{"error": {"message": "max_new_tokens must be positive"}}').code == "invalid_request"


async def test_an_adapter_the_engine_lost_is_loaded_again_and_the_request_sent_once_more() -> None:
    class RestartedEngine:
        """An engine that restarted: it has lost the adapter the worker believes loaded."""

        def __init__(self) -> None:
            self.loaded: set[str] = set()
            self.generate_calls = 0

        async def generate(self, request, headers):  # type: ignore[no-untyped-def]
            self.generate_calls += 1
            if request.adapter not in self.loaded:
                raise _http_error(400, b'{"error": {"message": "Got LoRA adapter that has never been loaded: x"}}')
            yield EngineUpdate(text="ok", token_ids=[7], completion_tokens=1, finish={"type": "length"})

        async def load_lora(self, name: str, path: str) -> dict:
            self.loaded.add(name)
            return {"success": True, "loaded_adapters": {name: path}}

        async def probe(self, lora_name: str | None = None) -> None:
            return None

    engine = RestartedEngine()
    spec = m.AdapterSpec(name="sql", base_model="m", version="sha256:" + "01" * 32, path="s3://ok/sql", created=0)

    async def lookup(name: str) -> m.AdapterSpec | None:
        return spec if name == "sql" else None

    adapters = Adapters(engine, lookup)  # type: ignore[arg-type]
    adapters.loaded[spec.engine_name] = spec  # loaded on the engine before it restarted
    request = m.InferenceRequest(
        request_id="r",
        tenant="t",
        model="m",
        prompt="p",
        reply_to="x",
        adapter=spec.engine_name,
        sampling=m.SamplingParams(max_new_tokens=1),
        deadline=1e12,
        created=0,
    )
    downs: list[str] = []
    updates = [update async for update in engine_stream(engine, adapters, request, {}, downs.append)]  # type: ignore[arg-type]
    assert [u.text for u in updates] == ["ok"] and engine.generate_calls == 2 and downs == []
    assert spec.engine_name in engine.loaded and adapters.names() == [spec.engine_name]


class CappedEngine:
    """An engine that keeps `cap` adapters and evicts the least recently loaded, as SGLang with
    --max-loaded-loras does (the order of loads stands in for use here)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.loaded: dict[str, str] = {}
        self.probes = 0

    async def load_lora(self, name: str, path: str) -> dict:
        self.loaded[name] = path
        while len(self.loaded) > self.cap:
            del self.loaded[next(iter(self.loaded))]
        return {"success": True, "loaded_adapters": dict(self.loaded)}

    async def probe(self, lora_name: str | None = None) -> None:
        self.probes += 1

    async def loaded_adapters(self) -> list[str]:
        return list(self.loaded)


def specs(*names: str) -> dict[str, m.AdapterSpec]:
    return {
        name: m.AdapterSpec(name=name, base_model="m", version="sha256:" + "ab" * 32, path=f"s3://{name}", created=0)
        for name in names
    }


async def test_the_worker_follows_the_engines_evictions_and_does_not_probe_a_reload_twice() -> None:
    known = specs("a", "b", "c")
    engine = CappedEngine(cap=2)

    async def lookup(name: str) -> m.AdapterSpec | None:
        return known.get(name)

    adapters = Adapters(engine, lookup)  # type: ignore[arg-type]
    for name in ("a", "b", "c"):
        await adapters.ensure(known[name].engine_name)
    assert adapters.names() == sorted([known["b"].engine_name, known["c"].engine_name])
    assert adapters.evictions == 1 and engine.probes == 3
    await adapters.ensure(known["a"].engine_name)  # evicted, loaded again: verified before on this engine
    assert engine.probes == 3 and known["a"].engine_name in adapters.names()
    # The engine restarts with nothing loaded but one adapter it loads at start-up.
    engine.loaded = {known["c"].engine_name: "s3://c"}
    await adapters.resync(restarted=True)
    assert adapters.names() == [known["c"].engine_name]
    await adapters.ensure(known["a"].engine_name)  # a new process: verified again
    assert engine.probes == 4
