"""Releases: immutable, content-addressed records of what serves a model, and the canary that
moves traffic from one to the next (docs/releases.md).

Pure parts: `record` (digests, validation, release ids), `split` (which release serves a request),
`slo_gate` and `eval_gate` (verdicts with their sample sizes), `canary` (the step controller).
I/O: `store` (the `models` KV bucket); the `inferbus release` and `inferbus eval` commands are in
`tools.commands.releases`.
"""
