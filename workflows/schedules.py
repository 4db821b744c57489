"""LaunchPlans for scheduled retraining: each run resumes from the latest published version of its run.

``resume="latest"`` makes every scheduled execution continue the named run where the previous one left
off, and ``max_steps`` bounds the work of one execution. The run's length stays ``loop.total_steps``
(raised by the overrides below): once a run reaches it, further executions return at once.

Register with ``pyflyte register workflows`` (or ``pyflyte --pkgs workflows package``); activate with
``flytectl update launchplan --activate``. Schedules only fire on a Flyte cluster, never locally.
"""

from __future__ import annotations

from datetime import timedelta

from flytekit import CronSchedule, FixedRate, LaunchPlan

from workflows.grpo import grpo

nightly_flow_grpo = LaunchPlan.get_or_create(
    grpo,
    name="nightly_sd35m_pickscore",
    fixed_inputs={"recipe": "sd35m-pickscore", "resume": "latest"},
    default_inputs={"overrides": ["loop.total_steps=100000"], "max_steps": 200},
    schedule=CronSchedule(schedule="0 2 * * *"),  # every day at 02:00 UTC
)
"""Flow-GRPO on SD3.5-medium with PickScore: a nightly chunk of training on the newest published version."""

weekly_ocr = LaunchPlan.get_or_create(
    grpo,
    name="weekly_sd35m_ocr",
    fixed_inputs={"recipe": "sd35m-ocr", "resume": "latest"},
    default_inputs={"overrides": ["loop.total_steps=100000"], "max_steps": 500},
    schedule=CronSchedule(schedule="0 3 * * 0"),  # Sundays at 03:00 UTC
)
"""Text rendering (OCR reward): a weekly session."""

math_every_6h = LaunchPlan.get_or_create(
    grpo,
    name="qwen3_math_every_6h",
    fixed_inputs={"recipe": "qwen3-math", "resume": "latest"},
    default_inputs={"overrides": ["loop.total_steps=100000"], "max_steps": 50},
    schedule=FixedRate(duration=timedelta(hours=6)),
)
"""GRPO on Qwen3 for math: continue every six hours."""

tiny_hourly = LaunchPlan.get_or_create(
    grpo,
    name="tiny_flow_grpo_hourly",
    fixed_inputs={"recipe": "tiny-flow-grpo", "resume": "latest"},
    default_inputs={"overrides": ["loop.total_steps=1000"], "max_steps": 2},
    schedule=FixedRate(duration=timedelta(hours=1)),
)
"""A smoke schedule for a new cluster: the tiny CPU recipe, hourly."""

SHARED_LORA_POOL = "sd35m-lora"
"""The named pool the shared-pool schedules attach to (``pool.name``): SD3.5-medium LoRA runs, one tenant each."""
SHARED_LORA_POOL_ADDRESS = "ray://sd35m-lora-pool-head-svc.default.svc.cluster.local:10001"
"""Its Ray cluster: a KubeRay RayCluster named ``sd35m-lora-pool`` (head service ``<name>-head-svc``); override
``pool.address`` in ``overrides`` for another."""

nightly_lora_shared_pool = LaunchPlan.get_or_create(
    grpo,
    name="nightly_sd35m_pickscore_shared_pool",
    fixed_inputs={"recipe": "sd35m-pickscore", "resume": "latest"},
    default_inputs={"overrides": ["loop.total_steps=100000", "name=sd35m-pickscore-shared", "pool.execution=pool",
                                  f"pool.name={SHARED_LORA_POOL}", f"pool.address={SHARED_LORA_POOL_ADDRESS}",
                                  "pool.publish=object_store"], "max_steps": 200},
    schedule=CronSchedule(schedule="30 2 * * *"),  # every day at 02:30 UTC
)
"""The nightly LoRA session as a tenant of the warm named pool ``sd35m-lora`` (``unirl_core/pool/tenants.py``):
its first step builds only its adapter in running processes; other LoRA runs of the base (``workflows/sweep.py``)
share the pool. Its inputs (the overrides) name the pool that served it."""
