"""Tune the affinity router's weights in the fleet simulator, on the live benchmark's workload.

    python -m bench.routing_tune [--load 0.8] [--seed 0] [--engines 4] SPEC [SPEC ...]

Each SPEC is `-` (the defaults) or comma-separated `field=value` pairs of `RoutingConfig` (and
`policy=least_loaded|round_robin|affinity`), e.g. `miss_weight=3 miss_weight=5,decode_weight_s=1`.
The workload is `bench.routing_workload.build`'s: 25% of the Mooncake trace's prefix families,
arrivals scaled so the fleet runs at `--load` of its capacity at the best-case hit rate, exactly
as `make bench-routing` replays it live. Prints one line per SPEC and writes
`bench/results/routing_tune.md`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import routing_workload
from inferbus.fleetsim import FleetConfig, FleetSim
from services.router.config import RoutingConfig

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_synthetic.jsonl"


def parse(spec: str) -> tuple[str, RoutingConfig]:
    fields = dict(pair.split("=", 1) for pair in spec.split(",")) if spec != "-" else {}
    policy = fields.pop("policy", "affinity")
    return policy, RoutingConfig(**{name: float(value) for name, value in fields.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", nargs="+", metavar="SPEC")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="seed of the family sample")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    workload = routing_workload.build(str(args.trace), engines=args.engines, sample_families=0.25,
                                      load=args.load, seed=args.seed)
    lines = [
        "# Router weights in the fleet simulator", "",
        f"`python -m bench.routing_tune --load {args.load} --seed {args.seed} {' '.join(args.specs)}`", "",
        f"{len(workload.requests)} requests at {workload.rate:.2f} req/s on {args.engines} engines; "
        f"best-case hit rate {workload.bound_hit_rate:.1%}, infinite-cache ceiling {workload.ceiling_hit_rate:.1%}.", "",
        "| spec | hit rate | TTFT p50 / p90 s | TPOT p90 ms | imbalance |", "| --- | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines[4:5]))
    for spec in args.specs:
        policy, config = parse(spec)
        report = FleetSim(FleetConfig(replicas=args.engines, policy=policy, seed=0, routing=config), workload.requests).run()
        row = (f"| {spec} | {report.hit_rate:.1%} | {report.ttft_p50_s:.2f} / {report.ttft_p90_s:.2f} | "
               f"{report.tpot_p90_s * 1e3:.0f} | {report.imbalance:.2f} |")
        print(row, flush=True)
        lines.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_tune.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
