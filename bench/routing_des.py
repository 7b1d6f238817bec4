"""Routing policies compared in the discrete-event fleet simulator (no real time, no network).

    python -m bench.routing_des [--replicas 8] [--load 0.8 | --rate R] [--trace PATH]
                                [--policies affinity,least_loaded,round_robin]
                                [--large-replicas 200] [--large-rate 833] [--limit N] [--out bench/results]

Every policy replays the same trace onto the same simulated engines (`tools.capacity.fleetsim`: the
router's own policy code, `services.sim_engine` engines with the roofline step time and KV
capacity of the chosen GPU). Two parts:

1. The comparison: `--replicas` (a comma list, e.g. `4,8`) at the rate that loads the fleet to
   `--load` of its perf-model capacity (`tools.capacity.fleetsim.capacity.rate_for_load`, basis
   `--basis`: "none" counts every prompt token as work, so every policy is at or below the load;
   "ideal" assumes the trace's infinite-cache hit rate), unless `--rate` is given.
2. Scale: `--large-replicas` at `--large-rate` req/s (the design's 833 req/s across 200
   replicas), to measure how fast the simulator is (CPU seconds, requests per CPU second).

Writes `routing_des.json`, `routing_des.md` and (with matplotlib) `routing_des.png` to `--out`.
"""

from __future__ import annotations

import argparse
import os
import platform as host
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import write_results
from services.router.policies import POLICY_NAMES
from services.sim_engine.config import EngineConfig
from tools.capacity import traces
from tools.capacity.fleetsim import FleetConfig, FleetSim, capacity, markdown_table, workload

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic.jsonl"


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in POLICY_NAMES:
            raise argparse.ArgumentTypeError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    return names


AREAS = (  # where CPU goes, by source path (first match wins)
    ("services/sim_engine/", "engine"),
    ("services/router/", "placement policy"),
    ("tools/capacity/fleetsim/", "simulator"),
    ("msgspec", "messages"),
    ("proto/", "messages"),
)
HASHING = "inferbus/tokens/blocks.py"


def profile_breakdown(profile: Any) -> dict[str, float]:
    """Own CPU time (cProfile tottime) per area. Built-ins are charged to whoever called them, and
    prefix hashing (`inferbus/tokens/blocks.py`) is shown apart, split by who asked for it."""
    import pstats

    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    memo: dict[Any, dict[str, float]] = {}

    def shares(key: Any, depth: int = 0) -> dict[str, float]:
        """How one function's own time divides between areas (fractions summing to 1)."""
        if key in memo:
            return memo[key]
        filename = key[0]
        result: dict[str, float]
        for marker, area in AREAS:
            if marker in filename:
                result = {area: 1.0}
                break
        else:
            callers = stats[key][4] if key in stats else {}
            if (filename == "~" or HASHING in filename) and callers and depth < 20:
                total = sum(c[2] for c in callers.values()) or float(len(callers))
                result = {}
                for caller, caller_stats in callers.items():
                    weight = (caller_stats[2] or (0.0 if total != len(callers) else 1.0)) / total
                    for area, share in shares(caller, depth + 1).items():
                        if HASHING in filename and not area.startswith("prefix hashing"):
                            area = f"prefix hashing, for the {area}"
                        result[area] = result.get(area, 0.0) + weight * share
            else:
                result = {"other": 1.0}
        memo[key] = result
        return result

    areas: dict[str, float] = {}
    for key, (_, _, own, _, _) in stats.items():
        for area, share in shares(key).items():
            areas[area] = areas.get(area, 0.0) + own * share
    return dict(sorted(areas.items(), key=lambda item: -item[1]))


def one_run(
    trace: list[traces.TraceRequest], engine: EngineConfig, replicas: int, policy: str, seed: int,
    profile: bool = False,
) -> dict[str, Any]:
    config = FleetConfig(replicas=replicas, policy=policy, engine=engine, seed=seed)
    sim = FleetSim(config, trace)
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        report = sim.run()
        profiler.disable()
        breakdown = profile_breakdown(profiler)
        total = sum(breakdown.values()) or 1.0
        print(f"  profile of {policy} × {replicas} (cProfile inflates the total):", flush=True)
        for area, seconds in breakdown.items():
            print(f"    {area:<40} {seconds:7.1f} s  {seconds / total:6.1%}")
        return {"policy": policy, "replicas": replicas, "profiled_cpu_s": report.cpu_s,
                "areas": {area: seconds / total for area, seconds in breakdown.items()}}
    report = sim.run()
    row = report.as_dict()
    print(f"  {policy:>12} × {replicas:<4} hit {report.hit_rate:6.1%}  TTFT p90 {report.ttft_p90_s * 1000:8,.0f} ms  "
          f"done {report.completed}/{report.requests}  CPU {report.cpu_s:6.1f} s  ({report.req_per_cpu_s:,.0f} "
          "req/CPU-s)",
          flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    engine = EngineConfig(gpu=args.gpu, tp=args.tp)
    full = traces.load(args.trace)
    base = full[: args.limit] if args.limit else full
    kv_tokens = engine.kv_capacity_tokens or 0
    if not kv_tokens:
        from inferbus.timing import roofline

        kv_tokens = roofline(engine.gpu, engine.tp, engine.preset).kv_capacity_tokens()
    estimates = {basis: capacity.estimate(base, engine, basis=basis) for basis in ("none", "ideal")}
    results: dict[str, Any] = {
        "command": "python -m bench.routing_des " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0], "platform": host.platform()},
        "trace": {
            "path": str(args.trace), "requests": len(base), "rate_rps": traces.rate(base),
            "mean_input_tokens": sum(r.input_tokens for r in base) / len(base),
            "mean_output_tokens": sum(r.output_tokens for r in base) / len(base),
            "ideal_hit_rate": traces.ideal_hit_rate(base),
        },
        "engine": {"gpu": engine.gpu, "tp": engine.tp, "preset": engine.preset, "kv_capacity_tokens": kv_tokens,
                   "chunked_prefill_size": engine.chunked_prefill_size, "block_size": engine.block_size,
                   "max_running_requests": engine.max_running_requests},
        "capacity": {basis: estimate.as_dict() for basis, estimate in estimates.items()},
        "load": args.load, "basis": args.basis, "fleets": [], "large": [],
    }

    for replicas in args.replicas:
        rate = args.rate or args.load * replicas * estimates[args.basis].replica_rps
        trace = workload.at_rate(base, rate)
        print(f"{replicas} replicas at {rate:.2f} req/s ({len(trace)} requests)", flush=True)
        fleet = {
            "replicas": replicas, "rate_rps": rate,
            "load_none": rate / (replicas * estimates["none"].replica_rps),
            "load_ideal": rate / (replicas * estimates["ideal"].replica_rps),
            "lru_hit_ceiling": capacity.lru_hit_rate(base, replicas * kv_tokens),
            "runs": [one_run(trace, engine, replicas, policy, args.seed) for policy in args.policies],
        }
        results["fleets"].append(fleet)

    for replicas in args.large_replicas:
        if args.large_rate <= 0:
            break
        trace = workload.at_rate(base, args.large_rate)
        print(f"{replicas} replicas at {args.large_rate:.0f} req/s ({len(trace)} requests)", flush=True)
        results["large"].append({
            "replicas": replicas, "rate_rps": args.large_rate,
            "load_none": args.large_rate / (replicas * estimates["none"].replica_rps),
            "load_ideal": args.large_rate / (replicas * estimates["ideal"].replica_rps),
            "replicas_for_80pct_none": capacity.replicas_for_rate(base, engine, args.large_rate, 0.8, basis="none"),
            "replicas_for_80pct_ideal": capacity.replicas_for_rate(base, engine, args.large_rate, 0.8, basis="ideal"),
            "lru_hit_ceiling": capacity.lru_hit_rate(base, replicas * kv_tokens),
            "runs": [one_run(trace, engine, replicas, policy, args.seed) for policy in args.large_policies],
        })
        if args.profile:
            results["large"][-1]["profile"] = one_run(trace, engine, replicas, args.large_policies[0], args.seed, True)
    return results


def markdown(results: dict[str, Any]) -> str:
    t, e = results["trace"], results["engine"]
    none, ideal = results["capacity"]["none"], results["capacity"]["ideal"]
    out = [
        f"# Routing policies in the discrete-event fleet simulator ({results['date']})",
        "",
        f"Command: `{results['command']}`. Machine: {results['machine']['cpus']} CPUs, Python "
        f"{results['machine']['python']}. Virtual time only: the router's policy code "
        "(`services/router/placement.py`) places every request from heartbeats, 250 ms load reports and "
        "per-step cache events (1 ms bus delay); each replica is the simulated engine "
        "(`services/sim_engine`). See `tools/capacity/fleetsim/`.",
        "",
        f"Trace: `{Path(t['path']).name}`, {t['requests']:,} requests, mean input {t['mean_input_tokens']:,.0f} / "
        f"output {t['mean_output_tokens']:,.0f} tokens, {t['rate_rps']:.2f} req/s as recorded; infinite-cache hit "
        f"rate {t['ideal_hit_rate']:.1%}. Replicas: {e['gpu']} TP{e['tp']} ({e['preset']} preset), KV "
        f"{e['kv_capacity_tokens']:,} tokens, chunked prefill {e['chunked_prefill_size']}, 64-token blocks.",
        "",
        "## Sizing: how the replay rate is chosen",
        "",
        "Perf-model capacity of one replica (`tools/capacity/fleetsim/capacity.py`, the roofline's fixed point): "
        "saturated when every step carries a full prefill chunk, λ_max = chunk / (mean uncached prompt "
        "tokens × t_step), with t_step the roofline step time for that chunk plus the decode batch "
        "B = chunk × mean output / mean uncached input riding along.",
        "",
        "| work basis | mean uncached prompt | decode batch B | t_step | λ_max per replica |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| none (every prompt token prefilled) | {none['mean_uncached_tokens']:,.0f} | {none['decode_batch']:.1f} "
        f"| {none['step_s'] * 1000:.1f} ms | {none['replica_rps']:.3f} req/s |",
        f"| ideal (infinite-cache hits) | {ideal['mean_uncached_tokens']:,.0f} | {ideal['decode_batch']:.1f} "
        f"| {ideal['step_s'] * 1000:.1f} ms | {ideal['replica_rps']:.3f} req/s |",
        "",
        f"Comparison runs replay at {results['load']:.0%} of the fleet's capacity on the `{results['basis']}` "
        "basis: rate = load × replicas × λ_max. Utilisation below is the share of time engines spent "
        "stepping; with continuous batching an engine steps whenever anything decodes, so it runs well "
        "above the prefill load.",
        "",
    ]
    for fleet in results["fleets"]:
        out += [
            f"## {fleet['replicas']} replicas at {fleet['rate_rps']:.2f} req/s",
            "",
            f"Load {fleet['load_none']:.0%} of capacity with no cache reuse, {fleet['load_ideal']:.0%} at the "
            f"infinite-cache hit rate. Best hit rate any router could reach on this fleet ≈ "
            f"{fleet['lru_hit_ceiling']:.1%} (one LRU cache the size of the fleet's KV).",
            "",
            markdown_table(fleet["runs"]),
        ]
    for large in results["large"]:
        out += [
            f"## Scale: {large['replicas']} replicas at {large['rate_rps']:.0f} req/s",
            "",
            f"The trace replayed in {large['runs'][0]['requests'] / large['rate_rps']:.1f} s of virtual time. "
            f"This mix is {large['load_ideal']:.1f}× (infinite-cache hits) to {large['load_none']:.1f}× (no reuse) "
            f"this fleet's capacity: 80% load at {large['rate_rps']:.0f} req/s would take "
            f"{large['replicas_for_80pct_ideal']:,.0f}–{large['replicas_for_80pct_none']:,.0f} replicas "
            "(the 200-replica figure comes from the design's 2k-token chat mix, not Mooncake's 15k-token "
            f"prompts). Queues build and drain, so latency is not the point here; simulator speed is. "
            f"Hit-rate ceiling of this fleet's KV: {large['lru_hit_ceiling']:.1%}.",
            "",
            markdown_table(large["runs"]),
            "| policy | CPU s | wall s | engine steps | events | events per CPU-s | requests per CPU-s | policy.place "
            "CPU s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in large["runs"]:
            out.append(
                f"| {r['policy']} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['steps']:,} | {r['events']:,} "
                f"| {r['events_per_cpu_s']:,.0f} | {r['req_per_cpu_s']:,.0f} | {r['placement_cpu_s']:.1f} |"
            )
        out.append("")
        profile = large.get("profile")
        if profile:
            out += [
                f"Where the CPU goes ({profile['policy']}, one more run under cProfile, own time by source, "
                "built-ins charged to their callers):",
                "",
                "| area | share |",
                "| --- | ---: |",
                *[f"| {area} | {share:.0%} |" for area, share in profile["areas"].items()],
                "",
            ]
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    groups = [(f"{f['replicas']} replicas\n{f['rate_rps']:.1f} req/s", f["runs"]) for f in results["fleets"]]
    groups += [(f"{g['replicas']} replicas\n{g['rate_rps']:.0f} req/s", g["runs"]) for g in results["large"]]
    if not groups:
        return False
    policies = list(dict.fromkeys(r["policy"] for _, runs in groups for r in runs))
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(1, len(policies))
    for i, policy in enumerate(policies):
        xs, hit_values, ttft_values = [], [], []
        for g, (_, runs) in enumerate(groups):
            row = next((r for r in runs if r["policy"] == policy), None)
            if row is not None:
                xs.append(g + (i - (len(policies) - 1) / 2) * width)
                hit_values.append(100 * row["hit_rate"])
                ttft_values.append(row["ttft_p90_s"] or 0.0)
        hits.bar(xs, hit_values, width, label=policy)
        ttft.bar(xs, ttft_values, width, label=policy)
    for axis, title, unit in ((hits, "prefix-cache hit rate (token-weighted)", "%"), (ttft, "TTFT p90", "s")):
        axis.set_xticks(range(len(groups)), [label for label, _ in groups])
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(axis="y", alpha=0.3)
    hits.axhline(100 * results["trace"]["ideal_hit_rate"], color="grey", linestyle="--", linewidth=1,
                 label="infinite cache")
    hits.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Routing policies, fleet simulator, {Path(results['trace']['path']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (Mooncake JSONL or Azure CSV)")
    parser.add_argument("--replicas", type=_ints, default=[8], help="fleet sizes to compare, e.g. 4,8")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of perf-model capacity to replay at")
    parser.add_argument("--basis", choices=("none", "ideal"), default="none", help="what counts as prefill work")
    parser.add_argument("--rate", type=float, default=None, help="replay rate in req/s (overrides --load)")
    parser.add_argument("--policies", type=_names, default=list(POLICY_NAMES), help="comma list")
    parser.add_argument("--large-replicas", type=_ints, default=[200], help="fleet sizes of the scale run")
    parser.add_argument("--large-rate", type=float, default=833.0, help="req/s of the scale run (0 skips it)")
    parser.add_argument("--large-policies", type=_names, default=list(POLICY_NAMES), help="comma list")
    parser.add_argument("--profile", action="store_true", help="profile one more scale run (cProfile) by area")
    parser.add_argument("--limit", type=int, default=None, help="only the first N requests of the trace")
    parser.add_argument("--gpu", default="H100")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="where routing_des.* go")
    args = parser.parse_args()
    results = run(args)
    write_results(args.out, "routing_des", results, markdown)
    if plot(results, args.out / "routing_des.png"):
        print(f"plot: {args.out / 'routing_des.png'}")


if __name__ == "__main__":
    main()
