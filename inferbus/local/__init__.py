"""The platform as processes on one machine (`inferbus up`, the test fixtures, the benchmarks and the
autoscaler's local actuator): the process stack (`stack`) and what it is made of (`stack_config`),
a simulated replica (`replicas`), one child process (`process`), nats-server and redis-server
(`servers`), readiness (`probes`), free ports (`ports`), owner-only files (`private_files`), a
multi-zone layout (`cluster`), TLS (`tls`)."""
