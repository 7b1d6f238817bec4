"""Placement policies, one per module, behind the `Policy` protocol; `make_policy` builds the one
the settings name. Every policy chooses among the workers that pass the registry's filters
(`services.router.registry`):

- `round_robin`: in turn (a baseline).
- `least_loaded`: the fewest requests per slot, counting placements not yet reported.
- `affinity` (the default): the lowest estimated time to first token from prefix cache hits,
  queued prefill, load and adapters.
"""

from .affinity import AffinityPolicy
from .base import Policy, RegistryPolicy
from .factory import POLICY_NAMES, PolicyName, make_policy
from .least_loaded import LeastLoadedPolicy
from .round_robin import RoundRobinPolicy

__all__ = [
    "POLICY_NAMES", "AffinityPolicy", "LeastLoadedPolicy", "Policy", "PolicyName", "RegistryPolicy",
    "RoundRobinPolicy", "make_policy",
]
