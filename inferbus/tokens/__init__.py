"""Token ids from the model directory to the engine's cache: prefix-block hashing (`blocks`), the
served model's tokenizer and chat template (`prompt`), a model directory built locally (`modeldir`),
the engine's KV events and blocks (`kv_events`, `kv_blocks`), continuing a request (`continuation`)."""
