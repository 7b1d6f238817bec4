"""Tune the affinity router's weights in the fleet simulator, on the live benchmark's workload.

    python -m bench.routing_tune [--load 0.8] [--seeds 0,1,2] [--sim-seeds 0] [--engines 4] [--table-engine]
        SPEC [SPEC ...]

Each SPEC is `-` (the defaults) or comma-separated `field=value` pairs of `RoutingConfig` (and
`policy=least_loaded|round_robin|affinity`), e.g. `miss_weight=3 miss_weight=5,decode_weight_s=1`.
The workload is `bench.routing_workload.build`'s: 25% of the Mooncake trace's prefix families,
arrivals scaled so the fleet runs at `--load` of its capacity at the best-case hit rate, exactly
as `make bench-routing` replays it live. With several `--seeds` every SPEC runs on each seed's
family sample and the row is the mean (imbalance also its worst): one sample of 4 engines is
decided by where a few big families land. `--sim-seeds` runs each sample again with other
simulator seeds (the softmax's draws and the load reports' phases): rows are then means over every
(sample, simulator seed) run, and the worst imbalance is the worst of all of them.

`--table-engine`: the engine the live benchmark and `bench.simulate_vs_dynamo` run, timed by the
GPU model's profile table with SGLang's default scheduling (no decode in a step that prefills),
as Dynamo's mocker; without it, the roofline with mixed prefill and decode steps.

Imbalance: max / mean over engines of all prompt + output tokens (cached prompt tokens included),
as the live benchmark reports it; in brackets, of the tokens computed (uncached prompt + output).
Prints one line per SPEC and writes `bench/results/<--name>.md` (default `routing_tune.md`).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench import routing_workload
from inferbus.timing import roofline
from services.router.config import RoutingConfig
from services.sim_engine.config import EngineConfig
from services.sim_engine.profile_table import TableStepModel, build_table, save_npz
from tools.capacity import traces
from tools.capacity.fleetsim import FleetConfig, FleetSim


def parse(spec: str) -> tuple[str, RoutingConfig]:
    fields = dict(pair.split("=", 1) for pair in spec.split(",")) if spec != "-" else {}
    policy = fields.pop("policy", "affinity")
    values: dict[str, Any] = {name: float(value) for name, value in fields.items()}
    return policy, RoutingConfig(**values)


def run_one(policy: str, config: RoutingConfig, requests: list[traces.TraceRequest], engines: int,
            engine: EngineConfig, step: Any, sim_seed: int = 0) -> dict[str, float]:
    sim = FleetSim(FleetConfig(replicas=engines, policy=policy, seed=sim_seed, routing=config, engine=engine), requests,
                   step_model=step)
    report = sim.run()
    tokens = [r.engine.prompt_tokens_total + r.engine.generation_tokens_total for r in sim.replicas]
    return {"hit_rate": report.hit_rate, "ttft_p50_s": report.ttft_p50_s, "ttft_p90_s": report.ttft_p90_s,
            "tpot_p90_s": report.tpot_p90_s, "imbalance_all": max(tokens) * len(tokens) / sum(tokens),
            "imbalance_computed": report.imbalance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", metavar="SPEC")
    parser.add_argument("--trace", type=Path, default=None, help="default: mooncake_synthetic.jsonl (traces.find)")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", default="0", help="comma list of family-sample seeds (rows are means)")
    parser.add_argument("--sim-seeds", default="0", help="comma list of simulator seeds per sample")
    parser.add_argument("--table-engine", action="store_true",
                        help="engines timed by the profile table, no mixed prefill/decode steps (as Dynamo's mocker)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="routing_tune", help="result file name (without extension)")
    args = parser.parse_args()
    trace = args.trace or traces.find("mooncake_synthetic.jsonl")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    sim_seeds = [int(s) for s in args.sim_seeds.split(",") if s.strip()]
    model = roofline("H100", 2)
    engine, step = EngineConfig(), None
    with tempfile.TemporaryDirectory(prefix="routing-tune-") as tmp:
        if args.table_engine:
            table = build_table(model)
            save_npz(table, Path(tmp) / "profile.npz")
            kv = model.kv_capacity_tokens() // engine.block_size * engine.block_size
            engine = EngineConfig(kv_capacity_tokens=kv, profile_table=str(Path(tmp) / "profile.npz"),
                                  mixed_chunk=False)
            step = TableStepModel(table)
        loads = [routing_workload.build(str(trace), engines=args.engines, sample_families=0.25, load=args.load,
                                        seed=seed, kv_capacity_tokens=engine.kv_capacity_tokens) for seed in seeds]
        command = (f"python -m bench.routing_tune --load {args.load} --seeds {args.seeds}"
                   f"{f' --sim-seeds {args.sim_seeds}' if sim_seeds != [0] else ''}"
                   f"{' --table-engine' if args.table_engine else ''} {' '.join(args.specs)}")
        lines = [
            "# Router weights in the fleet simulator", "", f"`{command}`", "",
            "Workloads (one per seed): " + "; ".join(
                f"{len(w.requests)} requests at {w.rate:.2f} req/s, best-case hit rate {w.bound_hit_rate:.1%}, "
                f"ceiling {w.ceiling_hit_rate:.1%}" for w in loads) + f"; {args.engines} engines"
            + (", profile-table engines without mixed steps." if args.table_engine else ", roofline engines.")
            + (f" Rows are means over the {len(seeds)} seeds" if len(seeds) > 1 else "")
            + (f" × {len(sim_seeds)} simulator seeds" if len(sim_seeds) > 1 else "")
            + ("." if len(seeds) > 1 or len(sim_seeds) > 1 else ""), "",
            "| spec | hit rate | TTFT p50 / p90 s | TPOT p90 ms | imbalance: all tokens, mean (worst) | computed | "
            "worst imbalance per sample |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        print(command, flush=True)
        for spec in args.specs:
            policy, config = parse(spec)
            config = dataclasses.replace(config, block_size=engine.block_size)
            per_sample = [[run_one(policy, config, w.requests, args.engines, engine, step, sim_seed)
                           for sim_seed in sim_seeds] for w in loads]
            runs = [run for sample in per_sample for run in sample]
            mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
            worst = max(r["imbalance_all"] for r in runs)
            by_sample = " / ".join(f"{max(r['imbalance_all'] for r in sample):.3f}" for sample in per_sample)
            row = (f"| {spec} | {mean['hit_rate']:.1%} | {mean['ttft_p50_s']:.2f} / {mean['ttft_p90_s']:.2f} | "
                   f"{mean['tpot_p90_s'] * 1e3:.0f} | {mean['imbalance_all']:.3f} ({worst:.3f}) | "
                   f"{mean['imbalance_computed']:.3f} | {by_sample} |")
            print(row, flush=True)
            lines.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
