"""The batch service's Prometheus metrics (one service per process: module-level, as prometheus_client
wants), shared by its shell and its parts."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

BATCHES = Gauge("inferbus_batch_batches", "Batches this service is running, by status", ["status"])
LINES_OUT = Gauge("inferbus_batch_lines_outstanding", "Lines published and without a result")
LINES_WAITING = Gauge("inferbus_batch_lines_waiting", "Lines of running batches not yet published")
PUBLISHED = Counter("inferbus_batch_lines_published_total", "Line attempts published", ["why"])
RESULTS = Counter("inferbus_batch_line_results_total", "Line results counted (first per line)", ["outcome"])
FINISHED = Counter("inferbus_batch_finished_total", "Batches that reached a final status", ["status"])
FEED = Gauge("inferbus_batch_feed", "Feed policy state (lines, or 1/0 for pressure)", ["signal"])
