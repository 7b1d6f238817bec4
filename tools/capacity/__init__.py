"""Capacity tools: workload mixes, the load sweep, the planner and the fleet simulators.

Above the services (the simulators run the services' pure policies), below the CLI."""
