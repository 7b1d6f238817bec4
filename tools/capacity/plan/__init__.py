"""Capacity planning: peak rate + workload mix + SLO → replicas, GPUs and dollars per GPU × TP.

`model` (steady state of one replica under the timing model), `sweep_table` (per-replica goodput
from a measured `inferbus sweep`), `costs`, `warm_pool`, `planner` (one row per GPU × TP),
`report` (markdown, JSON and plots) and `cli` (`inferbus plan`). See docs/planning.md.
"""
