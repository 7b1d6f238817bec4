"""The bus: the NATS connection and JetStream objects (`connection`), who may do what on it (`auth`,
`callout`), request/reply (`replies`, `reply_check`, `patience`), the durable outbox, the internal
OpenAI client, stream drift and security events."""
