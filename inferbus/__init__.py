"""The library the services share, in floors (each imports only those below it):
`step_cost` and `releases`; `stores`, `timing` and `zones`; `openai` and `local`; `bus` and
`tokens`; `runtime`. The wire (`proto`) is below them all; the services above, the tools above those."""
