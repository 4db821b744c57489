"""The enhancer's KL term pulls toward its warm-started self: the reference is the step-0 version RL started from
(written beside it at init, outside the stack's store), not the random init the model is built with."""

from __future__ import annotations

import pytest
import torch

from tests.unit.compose.conftest import small_config
from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.compose.config import ENHANCER_REFERENCE, enhancer_reference_uri, stack_configs
from unirl_core.compose.local import run_compose_local
from unirl_core.compose.phases import init_stacks
from unirl_core.errors import CheckpointError, ConfigError
from unirl_core.runtime import build
from unirl_core.models.lm import LMConfig, build_tiny_lm

torch.set_num_threads(1)

KL = ["enhancer.lm.algorithm.beta=0.1", "enhancer.lm.model.keep_reference=true", "image.frozen=true"]


def _ref_params(bundle) -> dict[str, torch.Tensor]:
    with bundle.reference():
        return {n: p.detach().clone() for n, p in bundle.module.named_parameters()}


def test_warm_start_with_beta_points_the_enhancer_reference_at_its_step0_weights(tmp_path):
    cfg = small_config(tmp_path, *KL)
    sub = stack_configs(cfg)["enhancer"]
    assert sub.lm.model.reference == enhancer_reference_uri(cfg) == f"{tmp_path}/enh/{ENHANCER_REFERENCE}/step-00000000"
    assert stack_configs(small_config(tmp_path, "image.frozen=true"))["enhancer"].lm.model.reference is None  # beta 0
    refs = init_stacks(cfg)
    step0 = load_weights(refs["enhancer"])
    saved = load_weights(CheckpointStore(f"{tmp_path}/enh", ENHANCER_REFERENCE).versions()[0])
    assert saved.keys() == step0.keys() and all(torch.equal(saved[k], step0[k]) for k in saved)
    trained = _ref_params(build.train_bundle(sub))  # what the trainer's KL term compares against
    initial = _ref_params(build.fresh_bundle(sub))  # the model as built: random init
    assert all(torch.equal(trained[n], step0[n]) for n in trained)
    assert any(not torch.equal(initial[n], step0[n]) for n in initial)  # the warm start moved it


@pytest.mark.slow
def test_first_update_has_ratio_one_and_zero_kl_to_the_warm_started_enhancer(tmp_path):
    """Step 1 trains from the step-0 version, which IS the reference: every per-token KL is exactly 0 (with the
    random init as reference it would be large), and the ratio is exactly 1."""
    hist = run_compose_local(small_config(tmp_path, *KL, "loop.total_steps=2"), progress=False)
    first, second = hist
    assert first["enhancer/train/kl"] == 0.0
    assert first["enhancer/train/ratio_min"] == first["enhancer/train/ratio_max"] == 1.0
    assert second["enhancer/train/kl"] > 0.0  # the policy moved away from its reference after one update


def test_kl_to_a_warm_start_needs_a_full_fine_tune_with_a_kept_reference(tmp_path):
    with pytest.raises(ConfigError, match=r"enhancer.lm.algorithm.beta=0.1.*finetune: full and keep_reference"):
        small_config(tmp_path, "enhancer.lm.algorithm.beta=0.1")  # the recipe keeps no reference copy
    with pytest.raises(ConfigError, match=r"enhancer.lm.algorithm.beta=0.1.*LoRA reference"):
        small_config(tmp_path, *KL, "enhancer.lm.model.finetune=lora")


def test_lm_reference_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"lm.reference='x'.*finetune: full and keep_reference"):
        LMConfig(model="tiny", finetune="lora", reference="x")
    with pytest.raises(ConfigError, match="lm.reference"):
        LMConfig(model="tiny", keep_reference=False, reference="x")
    bundle = build_tiny_lm(seed=0)
    with pytest.raises(CheckpointError, match=r"a tensor for every parameter"):
        bundle.load_reference_weights({"nope": torch.zeros(1)}, where="test")
    cfg = small_config(tmp_path, *KL)
    sub = stack_configs(cfg)["enhancer"]  # no init ran: the reference version is not written
    with pytest.raises(CheckpointError, match=r"lm.reference=.*enhancer-reference.*a complete checkpoint version"):
        build.train_bundle(sub)
