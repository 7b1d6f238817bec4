"""The platform as processes on one machine (`inferbus up`, the test fixtures, the benchmarks and the
autoscaler's local actuator): the process stack (`stack`), a multi-zone layout (`cluster`), TLS (`tls`)."""
