"""Where the loop's phases run: the executor interface (``executor``), the in-process executor (``inprocess``),
what both executors compute (``steps``) and what they build from a config (``build``). The Ray pool's executor is
``unirl_core.pool.executor``."""
