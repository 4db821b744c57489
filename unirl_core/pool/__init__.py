"""The run's Ray pool (``pool.execution: pool``): warm engine, trainer and reward actors behind the phases.

Importing this package does not import Ray; ``unirl_core.pool.cluster`` and ``unirl_core.pool.phases`` do,
on first use.
"""

from unirl_core.config.pool import ActorResources, PoolConfig

__all__ = ["ActorResources", "PoolConfig"]
