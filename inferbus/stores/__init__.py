"""The platform's records and where they are kept: tenants, API keys, admission counters, models,
files, batch records, the price book and the usage ledger. Shared by the services that read them."""
