"""Autoscaler: SLO-driven replica counts per model pool, a warm pool, and actuators (docs/autoscaling.md)."""
