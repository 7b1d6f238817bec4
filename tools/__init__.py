"""The tools that use the platform from above: the `inferbus` command line (`commands`), the
capacity tools (`capacity`: mixes, sweeps, the planner and the fleet simulators, which run the
services' pure policies offline) and the failure drills (`drill`). Nothing of the services or the
library imports them."""
