"""Prometheus metrics of the billing service (`INFERBUS_METRICS_PORT`, 9103 by default).

Token and dollar counters count each request once across all billing replicas: a replica counts
only the events its ingest call actually added to the rollups (a duplicate adds nothing).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

TOKENS = Counter("inferbus_billing_tokens_total", "Billed tokens rolled up from the usage ledger; kind: "
                 "input (prompt tokens, cached included), cached_input, output", ["tenant", "model", "kind"])
DOLLARS = Counter("inferbus_billing_dollars_total", "Billed US dollars rolled up from the usage ledger",
                  ["tenant", "model"])
EVENTS = Counter("inferbus_billing_events_total", "Usage events the rollup consumed; result: counted, "
                 "duplicate (its request id was counted before), invalid (undecodable)", ["result"])
BATCHES = Counter("inferbus_billing_batches_total", "Batches of usage events rolled up")
BATCH_SECONDS = Histogram("inferbus_billing_batch_seconds", "Time to roll up one batch (decode, price, Redis, ack)",
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
PENDING = Gauge("inferbus_billing_ledger_pending_events", "Usage events in the ledger not yet delivered to the rollup")
LAG = Gauge("inferbus_billing_ledger_lag_seconds", "Age of the newest usage event rolled up when it was rolled up")
EXPORTS = Counter("inferbus_billing_exports_total", "Monthly exports written, per tenant file; result: written, failed",
                  ["result"])
