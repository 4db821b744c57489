"""The compose loop through TrainBackend: exact ratio 1 on both Parts' first update, sibling stacks with their own
versions, frozen stacks, checkpoint/resume of both stacks and the roll-forward of a half-published step."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.compose.conftest import small_config
from unirl_core.checkpoint import CheckpointStore, load_weights
from unirl_core.compose.config import load_compose_recipe, stack_configs
from unirl_core.compose.local import run_compose_local
from unirl_core.compose.phases import init_stacks, rollout_phase, score_phase, train_phase
from unirl_core.errors import CheckpointError
from unirl_core.loop.phases import EMA_POLICY_VERSION, publish_phase

torch.set_num_threads(1)


def _weights(root, name, stack, step):
    store = CheckpointStore(f"{root}/{name}", stack)
    return load_weights([v for v in store.versions() if v.step == step][0])


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_first_update_is_exact_on_both_parts_and_both_stacks_version(tmp_path):
    cfg = small_config(tmp_path, "loop.total_steps=1")
    batches = []
    hist = run_compose_local(cfg, progress=False, on_step=lambda m, b: batches.append(b))
    m = hist[0]
    for stack in ("enhancer", "image"):
        assert m[f"{stack}/train/ratio_mean"] == 1.0
        assert m[f"{stack}/train/ratio_min"] == 1.0 and m[f"{stack}/train/ratio_max"] == 1.0
        assert [v.step for v in CheckpointStore(f"{tmp_path}/enh", stack).versions()] == [0, 1]
        assert json.loads((tmp_path / "enh" / stack / "LATEST").read_text())["step"] == 1
    assert m["enhancer/train/num_samples"] == 4 and m["image/train/num_samples"] == 8
    batch = batches[0]
    for stack, index in (("enhancer", 0), ("image", 1)):  # a stack moves when some advantage of its Part is non-zero
        moved = not _same(_weights(tmp_path, "enh", stack, 0), _weights(tmp_path, "enh", stack, 1))
        assert moved == any(s.parts[index].advantage != 0 for s in batch)
    assert any(s.parts[1].advantage != 0 for s in batch)
    assert all(s.parts[0].advantage is not None and s.parts[1].advantage is not None for s in batch)
    page = (tmp_path / "enh" / "report" / "step-00000001" / "samples.html").read_text()
    assert "enhanced prompt" in page and page.count("<img") == 8
    assert all(s.parts[0].text is None or f"<td>{s.parts[0].text}</td>" in page for s in batch
               if "<" not in (s.parts[0].text or ""))
    assert 'data-metric="reward/mean"' in (tmp_path / "enh" / "report" / "index.html").read_text()


@pytest.mark.parametrize("frozen", ["enhancer", "image"])
@pytest.mark.slow
def test_a_frozen_stack_keeps_its_step0_version_and_samples_with_it(tmp_path, frozen):
    cfg = small_config(tmp_path, f"{frozen}.frozen=true")
    batches = []
    hist = run_compose_local(cfg, progress=False, on_step=lambda m, b: batches.append(b))
    other = "image" if frozen == "enhancer" else "enhancer"
    assert [v.step for v in CheckpointStore(f"{tmp_path}/enh", frozen).versions()] == [0]
    assert [v.step for v in CheckpointStore(f"{tmp_path}/enh", other).versions()] == [0, 1, 2]
    assert not any(k.startswith(f"{frozen}/train/") for k in hist[-1])
    assert hist[0][f"{other}/train/ratio_mean"] == 1.0
    index = 0 if frozen == "enhancer" else 1
    assert {s.parts[index].policy_version for s in batches[-1]} == {0}
    assert {s.parts[1 - index].policy_version for s in batches[-1]} == {1}
    with pytest.raises(CheckpointError, match=f"{other}.frozen"):  # freezing a stack trained before is refused
        init_stacks(small_config(tmp_path, f"{other}.frozen=true"))


@pytest.mark.slow
def test_resume_of_both_stacks_equals_the_uninterrupted_run(tmp_path):
    straight = small_config(tmp_path / "a")
    run_compose_local(straight, progress=False)
    first = small_config(tmp_path / "b", "loop.total_steps=1")
    run_compose_local(first, progress=False)
    hist = run_compose_local(small_config(tmp_path / "b"), progress=False)
    assert [h["step"] for h in hist] == [2.0]
    for stack in ("enhancer", "image"):
        assert _same(_weights(tmp_path / "a", "enh", stack, 2), _weights(tmp_path / "b", "enh", stack, 2))


@pytest.mark.slow
def test_a_step_published_on_one_stack_only_is_rolled_forward(tmp_path):
    cfg = small_config(tmp_path, "loop.total_steps=1")
    refs = init_stacks(cfg)
    batch, _ = rollout_phase(cfg, refs, step=1)
    batch, _ = score_phase(cfg, batch)
    written, _ = train_phase(cfg, batch, refs, step=1)
    publish_phase(stack_configs(cfg)["enhancer"], written["enhancer"])  # stopped before the image publication
    assert CheckpointStore(f"{tmp_path}/enh", "image").latest().step == 0
    refs = init_stacks(cfg)
    assert refs["enhancer"].step == refs["image"].step == 1
    assert CheckpointStore(f"{tmp_path}/enh", "image").latest().step == 1


@pytest.mark.slow
def test_image_stack_under_nft_samples_with_its_ema_weights(tmp_path):
    cfg = small_config(tmp_path, "loop.total_steps=1", "image.diffusion.sampling.sde_type=ode",
                       "image.diffusion.sampling.sde_window_size=null", "image.diffusion.sampling.sde_window_range=null",
                       "image.diffusion.algorithm={name: nft, beta: 1.0, old_policy: ema, old_logp_source: replay}",
                       "image.train.old_logp_source=replay", "image.train.ema_decay=0.5")
    batches = []
    hist = run_compose_local(cfg, progress=False, on_step=lambda m, b: batches.append(b))
    assert {s.parts[1].policy_version for s in batches[0]} == {EMA_POLICY_VERSION}
    assert {s.parts[0].policy_version for s in batches[0]} == {0}
    assert hist[0]["enhancer/train/ratio_mean"] == 1.0 and "image/train/loss" in hist[0]
    assert [v.step for v in CheckpointStore(f"{tmp_path}/enh", "image").versions()] == [0, 1]


@pytest.mark.slow
def test_shipped_joint_recipe_first_update_is_exact_on_both_parts(tmp_path):
    # shapes-enhance-joint's own batch geometry (4 captions x 6 rewrites x 2 images, engine slices = micro-batches),
    # fewer denoising steps to keep it short
    cfg = load_compose_recipe("shapes-enhance-joint", [
        f"checkpoint.root={tmp_path}", "name=joint", "eval=null", "report.tensorboard=false", "loop.total_steps=1",
        "enhancer.warm_start.steps=5", "image.diffusion.sampling.num_steps=4",
        "image.diffusion.sampling.sde_window_size=2", "image.diffusion.sampling.sde_window_range=[0, 2]"])
    assert cfg.trained == ("enhancer", "image")
    m = run_compose_local(cfg, progress=False)[0]
    assert (m["enhancer/train/num_samples"], m["image/train/num_samples"]) == (24, 48)
    for stack in ("enhancer", "image"):
        assert m[f"{stack}/train/ratio_min"] == m[f"{stack}/train/ratio_mean"] == m[f"{stack}/train/ratio_max"] == 1.0
