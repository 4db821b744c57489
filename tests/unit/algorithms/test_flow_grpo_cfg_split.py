"""``diffusion.model.cfg_batch: split``: SD3's CFG branches as two forwards of B rows instead of one of 2B.

Rollout and replay share the field, so the first update stays exact; with Flow-GRPO's default ``cfg_grad: cond``
the unconditional branch then runs without autograd, so the backward covers B rows instead of 2B. The velocity
and the LoRA gradient equal the joint layout's (up to the float rounding of a different batch size).
"""

import copy
import dataclasses

import pytest
import torch

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig, stack_conditions
from unirl_core.types import SampleBatch

from tests.unit.algorithms.test_flow_grpo_cfg_grad import FBS, G
from tests.unit.algorithms.test_flow_grpo_cfg_grad import _rollout as rollout_with_advantages
from tests.unit.loop.test_exactness_matrix import RECIPES, assert_exact, overrides


def _bundle(cfg_batch: str, dtype: str = "float32") -> DiffusionBundle:
    return DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype=dtype,
                                                      cfg_batch=cfg_batch))


def _rollout(bundle: DiffusionBundle) -> SampleBatch:
    return rollout_with_advantages(bundle)[1]


def _forward_log(bundle: DiffusionBundle) -> tuple[list[tuple[int, bool]], object]:
    """(rows, grad enabled) of every transformer forward."""
    log: list[tuple[int, bool]] = []
    handle = bundle.module.register_forward_pre_hook(
        lambda _m, _a, kw: log.append((kw["hidden_states"].shape[0], torch.is_grad_enabled())), with_kwargs=True)
    return log, handle


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_replay_is_exact_and_the_uncond_branch_has_no_autograd(dtype):
    torch.set_num_threads(1)
    bundle = _bundle("split", dtype)
    batch = _rollout(bundle)
    log, handle = _forward_log(bundle)
    try:
        out = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, clip_range=1e-4, kl_beta=0.01)) \
            .loss(bundle, batch, old_log_probs=None)
        out.loss.backward()
    finally:
        handle.remove()
    m = out.metrics
    assert m["ratio_min"] == m["ratio_max"] == 1.0 and m["logp_absdiff_max"] == 0.0, m
    # per trained step: cond with grad, uncond without, then the KL reference's two branches without
    steps = len(log) // 4
    assert steps == 4 and log == [(FBS, True), (FBS, False), (FBS, False), (FBS, False)] * steps
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.module.parameters() if p.requires_grad)


def test_joint_layout_runs_one_forward_of_2b_rows_with_grad():
    torch.set_num_threads(1)
    bundle = _bundle("joint")
    batch = _rollout(bundle)
    log, handle = _forward_log(bundle)
    try:
        FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS)).loss(bundle, batch, old_log_probs=None).loss.backward()
    finally:
        handle.remove()
    assert log == [(2 * FBS, True)] * 4


@pytest.mark.parametrize("uncond_grad", [False, True])
def test_split_velocity_and_gradient_match_the_joint_layout(uncond_grad):
    torch.set_num_threads(1)
    joint = _bundle("joint")
    split = copy.deepcopy(joint)
    split.config = dataclasses.replace(joint.config, cfg_batch="split")
    batch = _rollout(joint)
    parts = batch.generated
    conds = stack_conditions([p.conditions for p in parts], joint.device)
    x = torch.stack([p.segment.latents[1] for p in parts]).float()
    grads, vels = [], []
    for b in (joint, split):
        v = b.guided_velocity(x, torch.tensor(0.7), b.prepare_cfg(conds, guidance_scale=G), guidance_scale=G,
                              uncond_grad=uncond_grad)
        params = [p for p in b.module.parameters() if p.requires_grad]
        grads.append(torch.autograd.grad(v.square().sum(), params))
        vels.append(v.detach())
    torch.testing.assert_close(vels[1], vels[0], rtol=1e-5, atol=1e-6)
    for gs, gj in zip(grads[1], grads[0]):
        torch.testing.assert_close(gs, gj, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_shipped_loop_with_split_cfg_is_exact_on_every_step(tmp_path):
    torch.set_num_threads(1)
    cfg = load_recipe(RECIPES["diffusion"], overrides("diffusion", "bfloat16", "lora", "never", tmp_path)
                      + ["diffusion.model.cfg_batch=split"])
    assert cfg.diffusion.model.cfg_batch == "split"
    assert_exact(run_local(cfg))


def test_bad_cfg_batch_names_the_field():
    with pytest.raises(ConfigError, match=r"model\.cfg_batch.*'joint' or 'split'"):
        DiffusionModelConfig(source="tiny-sd3", cfg_batch="both")
