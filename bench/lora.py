"""`python -m bench.lora` (`make bench-lora`): hundreds of LoRA adapters at the tail, measured.

The scenario: 200 adapters over 20 tenants (10 each, private to their tenant), streaming chat
whose adapter popularity is Zipf (exponent 1: the top 10 adapters get ≈ 50% of the traffic, the
hottest ≈ 17%), on a local platform of 4 simulated H100 TP2 workers (`inferbus.local.stack.Stack`, as the
tests start it) at a rate of 80% of what they hold on the base model at the SLO (p90 TTFT 0.8 s)
for this workload (400 ± 200 prompt tokens, 64 output tokens): 58.5 req/s, measured (see
MEASURED_CAPACITY_PER_WORKER), so 46.8 req/s. Then the same arrivals on the base model only, and
the same rate over 1,000 adapters (50 per tenant) on engines that keep at most `--cap` adapters
loaded (`--max-loaded-loras`).

The engines run 64 distinct adapters per batch (`--slots`, SGLang's `--max-loras-per-batch`), so
an engine's ~50-55 adapters (the routers give each adapter one home, hot ones more) all stay in its
GPU slots. With SGLang's default of 8 (the base model taking one) 200 Zipf adapters do not fit at
this load: ~120 requests in flight span ~70 distinct adapters against 4 × 7 adapter slots, and a
request whose adapter finds no slot is skipped by the scheduler while adapters already in the batch
keep admitting theirs (SGLang 0.5.23 does the same; its `--lora-drain-wait-threshold` is off by
default). Measured at 58.5 req/s with 8 slots: adapter TTFT p50/p90/p99 402/8,986/12,071 ms
against the base model's 171/856/1,569 ms. With 32 slots the batches fit but the ~20 adapters per
engine beyond its slots are copied in and out, one copy at a time, and a few at once set the p99
(293 ms against 166 ms with 64 slots when a copy cost 67 ms, bench/README.md). Slots cost HBM
(414 MB each at rank 16 on a 70B: 26.5 GB at 64, 39% of the KV cache of an H100 TP2 engine with
FP8 weights, far more than this load's ~10k resident tokens need), which the simulated engine does
not take out of its KV cache (the planner does). The engines also copy adapters into GPU slots
beside the steps (`--overlap-loading`, SGLang's `--enable-lora-overlap-loading`): with SGLang's
default every step that needs an adapter copied in waits for it (61 ms at rank 16).

The engines run `--time-scale` wall seconds per simulated second (default 10: a 2-core machine
shared with other work cannot carry the platform at full speed), arrivals are slowed by the same
factor, and every latency is reported in engine seconds (wall ÷ time scale), so the platform's
own CPU delays shrink by that factor too; the comparison between runs is what counts. The routers
read their adapter terms (load times, traffic shares, homes' lifetimes) in engine seconds too
(`INFERBUS_ROUTER_TIME_SCALE`, which the local stack sets from its engines' time scale), so they
weigh a load against the traffic it moves as they would at full speed.

Before the 200-adapter run every adapter gets one request (the engines load them), then `--steady`
engine-seconds of the same traffic with other arrivals, not measured: the routers' homes follow the
adapters' shares, and the loads that opening them takes (each stops its engine's batches for its
read, as SGLang reads adapters inside its scheduler's loop) are over before the measured run; the
run measures serving, not the platform converging after a start. The 1,000-adapter run first (`--settle`, the default)
waits while the routers prefetch registered adapters into the engines' host memory up to their cap
(`INFERBUS_ROUTER_ADAPTER_PREFETCH`: at the default cap of 300 all 1,000 fit in the 4 engines' host
memory; at `--cap 200`, 800 do), as a platform whose adapters were registered before their traffic
would, then warms its 100 most popular (their recent traffic: in the engines' least-recently-used
order they come after the prefetched ones), then runs the same `--steady` traffic; below a cap
that holds them all, the rest of the tail loads from disk and evicts while measured
(`--no-settle`: the whole tail does), each read stopping its engine's batches. Only prefetches run
while it settles, so the engines then run at `--settle-time-scale` (1: ten times faster in wall
time than the measured runs; sim-engine `--time-scale-control`): every simulated load takes what it
takes; its last 10 prefetches per worker run at the measured time scale, which the workers'
load-time estimates (wall seconds, priced by the routers) are learned at again before the warm-up. `--scenarios 1000`
runs the capped scenario alone and takes the 200-adapter rows (the base model's p99 for its verdict) from the
lora.json already in `--out`. Reported per run: TTFT p50/p90/p99 overall and per popularity class (hot: top 10,
middle: 11-50, tail: the rest), requests, errors, requests and adapter loads/evictions
per worker (the gateway's access log and the workers' `adapter_loaded`/`adapter_evicted` lines),
why adapters were loaded and evicted by popularity class (loads requests waited for against
prefetches, evictions and evicted adapters requested again, homes the routers opened: their
`adapter_home_warmed` and `adapter_prefetch_asked` lines), and per-worker imbalance (the busiest worker's requests ÷ the
mean). Targets: adapter p99 TTFT ≤ 2× the base model's, imbalance ≤ 1.2, no errors, at 200 and at 1,000 adapters.
Writes bench/results/lora.json and lora.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import percentile, write_results
from services.sim_engine.config import EngineConfig
from tools.capacity import mix as mix_mod
from tools.capacity.sweep.prompts import words
from tools.commands.simulate import size_fleet

RESULTS = Path(__file__).parent / "results"
MODEL = "meta-llama/Llama-3.3-70B-Instruct"
OUTPUT_TOKENS = 64
PROMPT_LOW, PROMPT_HIGH = 200, 600
HOT, MIDDLE = 10, 50  # popularity ranks 1-10 hot, 11-50 middle, the rest tail
# What one simulated H100 TP2 worker holds on this workload, base model only: a run at 58.5 req/s
# on 4 workers (the planner's goodput, 18.3 per worker, × 4 × 0.8) measured p90 TTFT 856 ms, just
# past the SLO's 800 ms: the planner's arithmetic is a little optimistic for this mix, and 58.5/4
# is where the SLO binds.
MEASURED_CAPACITY_PER_WORKER = 58.5 / 4
# Prefetches per worker made at the measured time scale at the end of a faster settle: the workers'
# load-time estimate (a mean weighting the latest load 0.3) is then within 3% of that scale's.
RELEARN_LOADS = 10


def workload() -> mix_mod.Mix:
    return mix_mod.from_spec({"name": "lora-chat", "classes": [{
        "name": "chat", "input_tokens": {"dist": "uniform", "low": PROMPT_LOW, "high": PROMPT_HIGH},
        "output_tokens": OUTPUT_TOKENS}]})


def zipf_weights(n: int, exponent: float = 1.0) -> list[float]:
    return [1.0 / (rank ** exponent) for rank in range(1, n + 1)]


def popularity_class(rank: int) -> str:
    return "hot" if rank <= HOT else "middle" if rank <= MIDDLE else "tail"


def arrivals(rate: float, seconds: float, adapters: int, seed: int) -> list[tuple[float, int, int]]:
    """(engine time, adapter rank 1..n, prompt tokens) of Poisson arrivals with Zipf adapters."""
    rng = random.Random(seed)
    weights = zipf_weights(adapters)
    ranks = list(range(1, adapters + 1))
    out: list[tuple[float, int, int]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.choices(ranks, weights)[0], rng.randint(PROMPT_LOW, PROMPT_HIGH)))


def adapter_name(rank: int) -> str:
    return f"ft-{rank:04d}"


def tenant_of(rank: int, tenants: int) -> str:
    return f"tenant-{(rank - 1) % tenants:02d}"


class Platform:
    """A local platform with tenants, keys and registered adapters."""

    def __init__(self, workers: int, time_scale: float, engine_args: list[str]) -> None:
        from inferbus.local.ports import free_port
        from inferbus.local.stack import Stack, StackConfig
        from tools.commands.main import new_admin_key

        self.state = Path(tempfile.mkdtemp(prefix="inferbus-bench-lora-"))
        self.stack = Stack(StackConfig(
            state_dir=self.state, workers=workers, time_scale=time_scale, gateway_port=free_port(),
            admin_key=new_admin_key(), batch=False, engine_args=engine_args,
            extra_env={"INFERBUS_REQUEST_TIMEOUT_S": "600", "INFERBUS_QUEUE_BUDGET_STANDARD_S": "1000000",
                       "INFERBUS_QUEUE_BUDGET_PREMIUM_S": "1000000"}))
        self.keys: dict[str, str] = {}

    def start(self) -> None:
        self.stack.start(timeout=180)

    def stop(self) -> None:
        self.stack.stop()
        if os.environ.get("INFERBUS_KEEP_LOGS") is None:
            self.stack.rmtree()

    def admin(self):  # type: ignore[no-untyped-def]
        import httpx

        return httpx.Client(base_url=self.stack.gateway_url + "/admin/v1", timeout=60,
                            headers={"authorization": f"Bearer {self.stack.config.admin_key}"})

    def setup(self, tenants: int, adapters: int) -> float:
        """Tenants with one key each, then every adapter in bulk; seconds the registration took."""
        with self.admin() as admin:
            for i in range(tenants):
                tenant = f"tenant-{i:02d}"
                response = admin.post("/tenants", json={"id": tenant})
                if response.status_code not in (201, 409):
                    raise RuntimeError(response.text)
                self.keys[tenant] = admin.post(f"/tenants/{tenant}/keys", json={"name": "bench"}).json()["secret"]
            entries = [{"name": adapter_name(rank), "version": "sha256:" + f"{rank:064x}",
                        "path": f"s3://bench/{adapter_name(rank)}", "owner": tenant_of(rank, tenants)}
                       for rank in range(1, adapters + 1)]
            started = time.perf_counter()
            for start in range(0, len(entries), 500):
                response = admin.post("/adapters/bulk", json={"adapters": entries[start:start + 500]})
                if response.status_code != 201:
                    raise RuntimeError(response.text)
            return time.perf_counter() - started

    def log_events(self, name: str, event: str, since: float) -> list[dict[str, Any]]:
        out = []
        path = self.state / "logs" / f"{name}.log"
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event and _ts(record) >= since:
                out.append(record)
        return out


def _ts(record: dict[str, Any]) -> float:
    from datetime import datetime

    stamp = record.get("timestamp")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else 0.0


def tokens_per_word(platform: Platform) -> float:
    """Tokens per generated word under the served model's tokenizer, so prompts have the lengths the
    capacity was computed for."""
    from inferbus.tokens.prompt import load_model

    sample = words(random.Random(0), 4000)
    return len(load_model(platform.stack.model_dir).encode(sample, add_special_tokens=False)) / 4000


async def replay(platform: Platform, plan: list[tuple[float, int, int]], time_scale: float, tenants: int,
                 base_only: bool, seed: int) -> list[dict[str, Any]]:
    import openai

    clients = {tenant: openai.AsyncOpenAI(base_url=platform.stack.gateway_url + "/v1", api_key=key, max_retries=0,
                                          timeout=600) for tenant, key in platform.keys.items()}
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    per_word = tokens_per_word(platform)

    async def one(rank: int, prompt_tokens: int, text: str) -> None:
        tenant = tenant_of(rank, tenants)
        model = MODEL if base_only else adapter_name(rank)
        started = time.perf_counter()
        record: dict[str, Any] = {"rank": rank, "class": popularity_class(rank), "error": None, "at": time.time()}
        try:
            stream = await clients[tenant].chat.completions.create(
                model=model, messages=[{"role": "user", "content": text}], max_tokens=OUTPUT_TOKENS,
                temperature=0, stream=True)
            async for chunk in stream:
                if "ttft_s" not in record and chunk.choices and chunk.choices[0].delta.content:
                    record["ttft_s"] = (time.perf_counter() - started) / time_scale
                    record["first_at"] = time.time()
                    record["id"] = chunk.id.removeprefix("chatcmpl-")  # the gateway's request_id
        except Exception as error:
            record["error"] = repr(error)[:200]
        records.append(record)

    tasks = []
    begin = time.perf_counter()
    for at, rank, prompt_tokens in plan:
        text = words(rng, max(1, round((prompt_tokens - 30) / per_word)))  # the chat template adds ~30
        delay = begin + at * time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(rank, prompt_tokens, text)))
    await asyncio.gather(*tasks)
    for client in clients.values():
        await client.close()
    return records


async def warm(platform: Platform, ranks: list[int], tenants: int, concurrency: int = 64) -> list[str]:
    """One one-token request per adapter (their engines load them); the errors."""
    import openai

    clients = {tenant: openai.AsyncOpenAI(base_url=platform.stack.gateway_url + "/v1", api_key=key, max_retries=0,
                                          timeout=900) for tenant, key in platform.keys.items()}
    gate = asyncio.Semaphore(concurrency)
    errors: list[str] = []

    async def one(rank: int) -> None:
        async with gate:
            try:
                await clients[tenant_of(rank, tenants)].chat.completions.create(
                    model=adapter_name(rank), messages=[{"role": "user", "content": "warm up"}], max_tokens=1)
            except Exception as error:
                errors.append(f"{adapter_name(rank)}: {error!r}"[:200])

    await asyncio.gather(*(one(rank) for rank in ranks))
    for client in clients.values():
        await client.close()
    return errors


def set_time_scale(platform: Platform, scale: float) -> None:
    """Every engine's wall seconds per simulated second (engines started with --time-scale-control)."""
    import httpx

    for process in platform.stack.processes:
        if process.name.startswith("engine-"):
            httpx.post(f"{process.detail}/time_scale", json={"time_scale": scale}, timeout=10).raise_for_status()


def settle(platform: Platform, workers: int, cap: int, quiet_s: float, max_s: float,
           holding: list[int] | None = None) -> dict[str, Any]:
    """Wait while the routers prefetch registered adapters into the engines' host memory: until every
    worker holds `cap` adapters, or no load for `quiet_s` wall seconds, or `max_s` have passed."""
    since = time.time()
    begin = last_change = time.perf_counter()
    count, holding = -1, list(holding or [0] * workers)
    while True:
        lines = [platform.log_events(f"worker-{i}", "adapter_loaded", since) for i in range(1, workers + 1)]
        now = time.perf_counter()
        if sum(map(len, lines)) != count:
            count, last_change = sum(map(len, lines)), now
        holding = [int(x[-1].get("loaded", 0)) if x else h for x, h in zip(lines, holding)]
        if all(h >= cap for h in holding) or now - last_change >= quiet_s or now - begin >= max_s:
            return {"wall_s": now - begin, "loads": count, "loaded_per_worker": holding}
        time.sleep(5)


def rank_of(engine_name: str) -> int | None:
    """The popularity rank of an adapter's engine name (`ft-0042@…` → 42)."""
    name = engine_name.partition("@")[0]
    return int(name[3:]) if name.startswith("ft-") and name[3:].isdigit() else None


def adapter_activity(records: list[dict[str, Any]], platform: Platform, workers: int, since: float) -> dict[str, Any]:
    """Why adapters were loaded and evicted while measured, by popularity class: loads a request
    waited for or the router asked for (`request`) against prefetches into host memory; homes the
    routers opened for an adapter already loaded elsewhere (`share`: its traffic asks for more
    homes; `crowded`: every home had more than its share of placements); evictions, and how many of
    the evicted adapters were requested again later in the run (each such request loads it again)."""
    classes = ("hot", "middle", "tail")

    def by_class() -> dict[str, int]:
        return dict.fromkeys(classes, 0)

    out: dict[str, Any] = {
        "loads": {"request": by_class(), "prefetch": by_class()},
        "evictions": by_class(),
        "evicted_then_requested": by_class(),
        "homes_opened": {"share": by_class(), "crowded": by_class()},
        "prefetches_asked": 0,
        "per_worker": {},
    }
    requested_at: dict[int, list[float]] = {}
    for record in records:
        requested_at.setdefault(record["rank"], []).append(record["at"])
    for i in range(1, workers + 1):
        worker = f"worker-{i}"
        mine = {"request": 0, "prefetch": 0, "evictions": 0, "evicted_then_requested": 0}
        for line in platform.log_events(worker, "adapter_loaded", since):
            rank = rank_of(line.get("adapter", ""))
            if rank is not None:
                kind = "prefetch" if line.get("prefetch") else "request"
                out["loads"][kind][popularity_class(rank)] += 1
                mine[kind] += 1
        for line in platform.log_events(worker, "adapter_evicted", since):
            rank = rank_of(line.get("adapter", ""))
            if rank is None:
                continue
            out["evictions"][popularity_class(rank)] += 1
            mine["evictions"] += 1
            if any(at > _ts(line) for at in requested_at.get(rank, ())):
                out["evicted_then_requested"][popularity_class(rank)] += 1
                mine["evicted_then_requested"] += 1
        out["per_worker"][worker] = mine
    for line in platform.log_events("router", "adapter_home_warmed", since):
        rank = rank_of(line.get("adapter", ""))
        if rank is not None:
            reason = "share" if int(line.get("homes", 0)) < int(line.get("wanted", 1)) else "crowded"
            out["homes_opened"][reason][popularity_class(rank)] += 1
    out["prefetches_asked"] = len(platform.log_events("router", "adapter_prefetch_asked", since))
    return out


WAITS = ("own load", "other load", "no load")


def waits_of_the_slowest(records: list[dict[str, Any]], platform: Platform, workers: int, since: float,
                         percentiles: tuple[int, ...] = (90, 99)) -> dict[str, Any]:
    """What the requests slower than the run's p90 and p99 waited for, by popularity class: a load of
    their own adapter on the worker that served them (`own load`), a load of another adapter there
    (`other load`: the engine runs no batch while it reads one), or neither (`no load`: batch slots,
    copies into GPU slots, queueing). A load is an interval of a worker's `adapter_loaded` log line
    (its `load_s`, the wait for its turn included); a request is the time from its arrival to its
    first token, on the worker the gateway's access log names for it."""
    worker_of = {
        line.get("request_id"): line.get("worker") for line in platform.log_events("gateway", "request", since)
    }
    loads: dict[str, list[tuple[float, float, int | None]]] = {}
    for i in range(1, workers + 1):
        worker = f"worker-{i}"
        loads[worker] = [(_ts(line) - float(line.get("load_s", 0.0)), _ts(line), rank_of(line.get("adapter", "")))
                         for line in platform.log_events(worker, "adapter_loaded", since)]  # logged at its end
    timed = [r for r in records if r["error"] is None and "first_at" in r]
    out: dict[str, Any] = {}
    if not timed:
        return out
    for pct in percentiles:
        threshold = percentile([r["ttft_s"] for r in timed], pct)
        counts = {c: dict.fromkeys(WAITS, 0) for c in ("hot", "middle", "tail")}
        for record in (r for r in timed if r["ttft_s"] > threshold):
            overlapping = [rank for start, end, rank in loads.get(worker_of.get(record["id"]) or "", [])
                           if start < record["first_at"] and end > record["at"]]
            wait = ("own load" if record["rank"] in overlapping else "other load" if overlapping else "no load")
            counts[record["class"]][wait] += 1
        out[f"p{pct}"] = {"threshold_ms": threshold * 1000, "by_class": counts}
    return out


def summarise(records: list[dict[str, Any]], platform: Platform, workers: int, since: float) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None and "ttft_s" in r]
    errors = [r["error"] for r in records if r["error"] is not None]

    def latency(rows: list[dict[str, Any]]) -> dict[str, float | int]:
        values = [r["ttft_s"] * 1000 for r in rows]
        return {"n": len(values), "p50_ms": percentile(values, 50), "p90_ms": percentile(values, 90),
                "p99_ms": percentile(values, 99)}

    per_worker: dict[str, dict[str, int]] = {f"worker-{i}": {"requests": 0, "loads": 0, "evictions": 0}
                                             for i in range(1, workers + 1)}
    for line in platform.log_events("gateway", "request", since):
        worker = line.get("worker")
        if worker in per_worker and line.get("completion_tokens", 0) > 1:  # not the warm-up's one-token calls
            per_worker[worker]["requests"] += 1
    for worker in per_worker:
        per_worker[worker]["loads"] = len(platform.log_events(worker, "adapter_loaded", since))
        per_worker[worker]["evictions"] = len(platform.log_events(worker, "adapter_evicted", since))
    counts = [w["requests"] for w in per_worker.values()]
    mean = sum(counts) / len(counts) if counts else 0.0
    return {
        "requests": len(records), "completed": len(ok), "errors": len(errors), "error_samples": errors[:5],
        "ttft": latency(ok),
        "ttft_by_class": {c: latency([r for r in ok if r["class"] == c]) for c in ("hot", "middle", "tail")},
        "per_worker": per_worker,
        "imbalance": max(counts) / mean if mean else None,
        "adapter_activity": adapter_activity(records, platform, workers, since),
        "slowest": waits_of_the_slowest(records, platform, workers, since),
    }


def run_stack(args: argparse.Namespace, adapters: int, engine_args: list[str], runs: list[tuple[str, bool]],
              warm_ranks: int, rate: float, cap: int = 0) -> dict[str, Any]:
    platform = Platform(args.workers, args.time_scale, engine_args)
    print(f"starting {args.workers} workers ({' '.join(engine_args) or 'no engine flags'}) for {adapters} adapters",
          flush=True)
    platform.start()
    out: dict[str, Any] = {"adapters": adapters, "engine_args": engine_args}
    try:
        out["registration_s"] = platform.setup(args.tenants, adapters)
        if cap and getattr(args, "settle", False):
            # The time between registration and traffic: the routers prefetch adapters into the
            # engines' host memory meanwhile. Then the warm-up stands for the recent traffic, which
            # a live platform's popular adapters have had since (and the engines' LRU order shows).
            # Nothing but prefetches runs meanwhile, so the engines may run faster in wall time
            # (--settle-time-scale) without changing any simulated load time. The workers learn
            # their load time in wall seconds, though, and the routers price loads with it: the
            # last RELEARN_LOADS prefetches per worker run at the measured time scale, so the
            # warm-up places as it would after a settle at that scale.
            settle_scale = getattr(args, "settle_time_scale", 0.0)
            out["prefetch"] = {"wall_s": 0.0, "loads": 0}
            if settle_scale and cap > RELEARN_LOADS:
                set_time_scale(platform, settle_scale)
                fast = settle(platform, args.workers, cap - RELEARN_LOADS, quiet_s=30.0, max_s=args.settle_max)
                set_time_scale(platform, args.time_scale)
                out["prefetch"] = {"wall_s": fast["wall_s"], "loads": fast["loads"], "time_scale": settle_scale,
                                   "fast_loads_per_worker": fast["loaded_per_worker"]}
            rest = settle(platform, args.workers, cap, quiet_s=30.0, max_s=args.settle_max,
                          holding=out["prefetch"].get("fast_loads_per_worker"))
            out["prefetch"] = {**out["prefetch"], "wall_s": out["prefetch"]["wall_s"] + rest["wall_s"],
                               "loads": out["prefetch"]["loads"] + rest["loads"],
                               "loaded_per_worker": rest["loaded_per_worker"]}
            print(f"  prefetched {out['prefetch']['loads']} adapters in {out['prefetch']['wall_s']:.0f} s, "
                  f"holding {out['prefetch']['loaded_per_worker']}", flush=True)
        warm_started = time.time()
        begin = time.perf_counter()
        out["warmup_errors"] = asyncio.run(warm(platform, list(range(1, warm_ranks + 1)), args.tenants))
        out["warmup"] = {"adapters": warm_ranks, "wall_s": time.perf_counter() - begin,
                         "loads": sum(len(platform.log_events(f"worker-{i}", "adapter_loaded", warm_started))
                                      for i in range(1, args.workers + 1))}
        print(f"  warmed {warm_ranks} adapters in {out['warmup']['wall_s']:.0f} s", flush=True)
        steady = getattr(args, "steady", 0.0)
        if steady > 0:
            # The same traffic (other arrivals) before measuring, not measured: the routers' shares and
            # homes follow it, and the loads that opening those homes takes are over before the run.
            since, begin = time.time(), time.perf_counter()
            asyncio.run(replay(platform, arrivals(rate, steady, adapters, args.seed + 100), args.time_scale,
                               args.tenants, False, args.seed + 101))
            out["steady"] = {"engine_s": steady, "wall_s": time.perf_counter() - begin,
                             "loads": sum(len(platform.log_events(f"worker-{i}", "adapter_loaded", since))
                                          for i in range(1, args.workers + 1))}
            print(f"  {steady:g} engine-seconds of steady traffic, {out['steady']['loads']} loads", flush=True)
        plan = arrivals(rate, args.seconds, adapters, args.seed)
        for name, base_only in runs:
            since = time.time()
            begin = time.perf_counter()
            records = asyncio.run(replay(platform, plan, args.time_scale, args.tenants, base_only, args.seed + 1))
            result = summarise(records, platform, args.workers, since)
            result["wall_s"] = time.perf_counter() - begin
            out[name] = result
            print(f"  {name}: {result['completed']}/{result['requests']} ok, TTFT p50/p90/p99 "
                  f"{result['ttft']['p50_ms']:.0f}/{result['ttft']['p90_ms']:.0f}/{result['ttft']['p99_ms']:.0f} ms, "
                  f"imbalance {result['imbalance']}", flush=True)
    finally:
        platform.stop()
    return out


def verdicts(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    base = results["at_200"]["base"]["ttft"]["p99_ms"]
    for key, label in (("at_200", "200 adapters"), ("at_1000", f"1,000 adapters, cap {results['inputs']['cap']}")):
        run = results.get(key, {}).get("lora")
        if not run:
            continue
        p99 = run["ttft"]["p99_ms"]
        rows.append({"run": label, "target": "adapter p99 TTFT ≤ 2× base", "value": f"{p99:.0f} vs 2 × {base:.0f} ms",
                     "met": p99 <= 2 * base})
        rows.append({"run": label, "target": "per-worker imbalance ≤ 1.2", "value": f"{run['imbalance']:.2f}",
                     "met": run["imbalance"] is not None and run["imbalance"] <= 1.2})
        rows.append({"run": label, "target": "zero errors", "value": str(run["errors"]), "met": run["errors"] == 0})
    return rows


def markdown(results: dict[str, Any]) -> str:
    inputs = results["inputs"]
    lines = [
        "# LoRA adapters at the tail (`make bench-lora`)", "",
        f"{inputs['workers']} simulated H100 TP2 workers, {inputs['tenants']} tenants, Zipf(1) adapter popularity, "
        f"prompts {PROMPT_LOW}-{PROMPT_HIGH} tokens, {OUTPUT_TOKENS} output tokens, streamed, engines with "
        f"--max-loras-per-batch {inputs['slots']}"
        f"{' --enable-lora-overlap-loading' if inputs.get('overlap_loading') else ''}. Rate {inputs['rate_rps']:.1f} "
        f"req/s (engine time) = {inputs['share']:.0%} of {inputs['capacity_rps']:.1f} req/s, what the workers hold on "
        f"the base model at the SLO (the planner's goodput is {inputs['goodput_rps']:.2f} req/s per worker); "
        f"{inputs['seconds']:.0f} engine-seconds per run at time scale {inputs['time_scale']:g} "
        f"(latencies in engine milliseconds). Machine: {inputs['machine']}.", "",
        *(f"{note}\n" for note in results.get("notes", [])),
        "| run | requests | errors | TTFT p50 / p90 / p99 ms | p90 hot / middle / tail ms | p99 hot / middle / tail ms "
        "| imbalance |",
        "| --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for key, title in (("at_200", "200"), ("at_1000", "1,000")):
        block = results.get(key)
        if not block:
            continue
        for name in ("lora", "base"):
            run = block.get(name)
            if not run:
                continue
            t, by = run["ttft"], run["ttft_by_class"]
            label = f"{title} adapters" if name == "lora" else "base model only (same arrivals)"
            lines.append(
                f"| {label} | {run['requests']} | {run['errors']} | {t['p50_ms']:.0f} / {t['p90_ms']:.0f} / "
                f"{t['p99_ms']:.0f} | "
                + (" / ".join(f"{by[c]['p90_ms']:.0f}" for c in ("hot", "middle", "tail")) if name == "lora" else "")
                + " | "
                + (" / ".join(f"{by[c]['p99_ms']:.0f}" for c in ("hot", "middle", "tail")) if name == "lora" else "")
                + f" | {run['imbalance']:.2f} |")
    lines += ["", "Per worker (requests / adapter loads / evictions during the measured run):", "",
              "| run | " + " | ".join(f"worker-{i}" for i in range(1, inputs["workers"] + 1)) + " |",
              "| --- |" + " ---: |" * inputs["workers"]]
    for key, title in (("at_200", "200 adapters"), ("at_1000", "1,000 adapters")):
        for name in ("lora", "base"):
            run = results.get(key, {}).get(name)
            if run:
                lines.append(f"| {title}, {'adapters' if name == 'lora' else 'base model only'} | " + " | ".join(
                    f"{w['requests']} / {w['loads']} / {w['evictions']}" for w in run["per_worker"].values()) + " |")
    activity_rows = []
    for key, title in (("at_200", "200 adapters"), ("at_1000", "1,000 adapters")):
        run = results.get(key, {}).get("lora")
        if run and "adapter_activity" in run:
            a = run["adapter_activity"]

            def triple(counts: dict[str, int]) -> str:
                return " / ".join(str(counts[c]) for c in ("hot", "middle", "tail"))

            activity_rows.append(
                f"| {title} | {triple(a['loads']['request'])} | {triple(a['loads']['prefetch'])} | "
                f"{triple(a['evictions'])} | {triple(a['evicted_then_requested'])} | "
                f"{triple(a['homes_opened']['share'])} | "
                f"{triple(a['homes_opened']['crowded'])} | {a['prefetches_asked']} |")
    if activity_rows:
        lines += ["", "Adapter loads and evictions during the measured run by popularity class, hot / middle / tail "
                  "(loads a request waited for or the router asked for; prefetches into host memory; evictions; "
                  "evicted adapters requested again later in the run; homes opened for an adapter loaded elsewhere "
                  "because its share asked for more, or because every home had more than its share of placements):", "",
                  "| run | loads | prefetch loads | evictions | evicted, requested again | homes opened: share | "
                  "homes opened: crowded | prefetches asked |",
                  "| --- | --- | --- | --- | --- | --- | --- | ---: |", *activity_rows]
    slow_rows = []
    for key, title in (("at_200", "200 adapters"), ("at_1000", "1,000 adapters")):
        for name in ("lora", "base"):
            run = results.get(key, {}).get(name)
            for pct, slow in (run or {}).get("slowest", {}).items():
                cells = [
                    " / ".join(str(slow["by_class"][c][wait]) for c in ("hot", "middle", "tail")) for wait in WAITS
                ]
                slow_rows.append(f"| {title}, {'adapters' if name == 'lora' else 'base model only'} | over {pct} "
                                 f"({slow['threshold_ms']:.0f} ms) | " + " | ".join(cells) + " |")
    if slow_rows:
        lines += ["", "What the slowest requests waited for, hot / middle / tail (for the base model, the classes of "
                  "the adapters the same arrivals name): a load of their own adapter on their worker; a load of "
                  "another adapter there (no batch runs while the engine reads one); neither:", "",
                  "| run | requests over the run's | own load | other load | no load |",
                  "| --- | --- | --- | --- | --- |", *slow_rows]
    lines += ["", "Warm-up and registration: " + "; ".join(
        f"{results[k]['adapters']} adapters registered in bulk in {results[k]['registration_s']:.1f} s, "
        f"{results[k]['warmup']['adapters']} warmed ({results[k]['warmup']['loads']} loads, "
        f"{results[k]['warmup']['wall_s']:.0f} s wall)"
        + (f", after {results[k]['prefetch']['loads']} were prefetched into host memory by the routers in "
           f"{results[k]['prefetch']['wall_s']:.0f} s wall (adapters loaded per worker then: "
           f"{' / '.join(map(str, results[k]['prefetch']['loaded_per_worker']))})" if "prefetch" in results[k] else "")
        + (f", then {results[k]['steady']['engine_s']:g} engine-seconds of the same traffic, not measured "
           f"({results[k]['steady']['loads']} loads)" if "steady" in results[k] else "")
        for k in ("at_200", "at_1000") if k in results), "",
              "| run | target | measured | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {v['run']} | {v['target']} | {v['value']} | {'yes' if v['met'] else '**no**'} |"
              for v in results["verdicts"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="simulated H100 TP2 workers (`inferbus up --workers`)")
    parser.add_argument("--tenants", type=int, default=20, help="tenants the adapters are spread over, evenly")
    parser.add_argument(
        "--adapters", type=int, default=200, help="the first scenario's adapters (engines without a cap)"
    )
    parser.add_argument("--many-adapters", type=int, default=1000, help="the second scenario's adapters (0: skip it)")
    parser.add_argument(
        "--cap",
        type=int,
        default=300,
        help="--max-loaded-loras of the engines in the second scenario (300: the 4 engines' host memory "
        "holds all 1,000 adapters; below that the tail is read from disk while serving)",
    )
    parser.add_argument("--capacity", type=float, default=None,
                        help="req/s the workers hold on the base model (default: measured, see the module docstring)")
    parser.add_argument("--share", type=float, default=0.8, help="the rate as a share of that capacity")
    parser.add_argument("--slots", type=int, default=64,
                        help="the engines' --max-loras-per-batch (distinct adapters per batch, base model included)")
    parser.add_argument(
        "--overlap-loading",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="engines copy adapters into GPU slots beside the steps (SGLang's --enable-lora-overlap-loading)",
    )
    parser.add_argument("--settle", action=argparse.BooleanOptionalAction, default=True,
                        help="before measuring the capped scenario, wait while the routers prefetch adapters into "
                             "the engines' host memory (up to the cap)")
    parser.add_argument("--settle-max", type=float, default=1200.0, help="at most this many wall seconds of it")
    parser.add_argument("--settle-time-scale", type=float, default=1.0,
                        help="the engines' time scale while settling (0: --time-scale): only prefetch loads run then, "
                             "whose simulated times do not change")
    parser.add_argument("--scenarios", default="200,1000",
                        help="which to run: 200 (with the base-model run) and/or 1000; a run of 1000 alone takes the "
                             "200-adapter results (for the base model's p99) from the existing lora.json in --out")
    parser.add_argument("--seconds", type=float, default=24.0, help="engine-seconds of arrivals per run")
    parser.add_argument("--steady", type=float, default=12.0,
                        help="engine-seconds of the same traffic (other arrivals) after the warm-up and before the "
                             "adapter run, not measured, so the routers' homes follow the shares first (0: none)")
    parser.add_argument("--time-scale", type=float, default=10.0, help="wall seconds per engine second")
    parser.add_argument("--seed", type=int, default=23, help="seed of the arrivals, prompts and adapter popularity")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of lora.json and lora.md")
    args = parser.parse_args()

    goodput = size_fleet(workload(), EngineConfig(), 1.0).replica_goodput_rps
    capacity = args.capacity if args.capacity is not None else MEASURED_CAPACITY_PER_WORKER * args.workers
    rate = args.share * capacity
    results: dict[str, Any] = {
        "inputs": {
            "workers": args.workers,
            "tenants": args.tenants,
            "adapters": args.adapters,
            "many_adapters": args.many_adapters,
            "cap": args.cap,
            "share": args.share,
            "goodput_rps": goodput,
            "capacity_rps": capacity,
            "slots": args.slots,
            "overlap_loading": args.overlap_loading,
            "rate_rps": rate,
            "seconds": args.seconds,
            "steady_s": args.steady,
            "settle": args.settle,
            "time_scale": args.time_scale,
            "seed": args.seed,
            "settle_time_scale": args.settle_time_scale,
            "scenarios": args.scenarios,
            "machine": f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start",
        }
    }
    print(f"rate {rate:.1f} req/s engine time ({rate / args.time_scale:.2f} wall)", flush=True)
    slots = ["--max-loras-per-batch", str(args.slots)] + (
        ["--enable-lora-overlap-loading"] if args.overlap_loading else []
    )
    scenarios = {part.strip() for part in args.scenarios.split(",") if part.strip()}
    if "200" in scenarios:
        results["at_200"] = run_stack(args, args.adapters, slots, [("lora", False), ("base", True)],
                                      warm_ranks=args.adapters, rate=rate)
        results["verdicts"] = verdicts(results)
        write_results(args.out, "lora", results, markdown)  # kept if the second scenario fails
    else:
        results["at_200"] = json.loads((args.out / "lora.json").read_text())["at_200"]
    if args.many_adapters and "1000" in scenarios:
        control = ["--time-scale-control"] if args.settle and args.settle_time_scale else []
        results["at_1000"] = run_stack(
            args,
            args.many_adapters,
            [*slots, "--max-loaded-loras", str(args.cap), *control],
            [("lora", False)],
            warm_ranks=min(100, args.many_adapters),
            rate=rate,
            cap=args.cap,
        )
        results["verdicts"] = verdicts(results)
        write_results(args.out, "lora", results, markdown)


if __name__ == "__main__":
    main()
