"""What every process stands on: its settings, logs and traces, optional extras, restart backoff,
its zone, its Redis connection, and reading stored records that may not decode."""
