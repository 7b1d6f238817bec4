"""`inferbus sweep`: concurrency and request-rate sweeps against OpenAI-compatible endpoints.

`prompts` turns mix requests into request bodies, `loadgen` sends them and records timings,
`metrics` turns records into step statistics (aiperf's definitions), `report` writes JSON, CSV
and plots, `cli` is the command. The simulated engine serves the OpenAI endpoints a sweep needs
(`services/sim_engine/openai_api.py`).
"""
