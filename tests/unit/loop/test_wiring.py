"""Settings the loop must actually use: the Flux schedule, sigma_verify, the policy-lag bound, EMA rollout
weights and the decode-vs-rescore gap metric."""

import dataclasses

import pytest
import torch

from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError, NumericsError
from unirl_core.loop import phases
from unirl_core.loop.local import run_local
from unirl_core.sde import flow_sigmas, flux_sigmas


def _diffusion(tmp_path, *extra):
    return load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1",
                                          "data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=4",
                                          "train.micro_batch_size=4", "diffusion.sampling.height=32",
                                          "diffusion.sampling.width=32", *extra])


def test_flux_model_gets_the_dynamic_shift_schedule(tmp_path):
    cfg = _diffusion(tmp_path, "diffusion.model.source=tiny-flux", "diffusion.model.finetune=lora")
    ckpt = phases.init_run(cfg)
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    want = flux_sigmas(num_steps=10, image_seq_len=(32 // 16) * (32 // 16))
    assert want != flow_sigmas(num_steps=10, shift=3.0)
    assert all(p.sampling.sigmas == want for p in batch.generated)
    # an explicit schedule wins over the family's
    assert load_recipe("tiny-flow-grpo", ["diffusion.sampling.schedule=sd3"]).diffusion.sampling.sigmas("flux") == \
        flow_sigmas(num_steps=10, shift=3.0)


def test_rollout_rejects_an_engine_echo_that_differs_from_the_pin(tmp_path, monkeypatch):
    cfg = _diffusion(tmp_path)
    ckpt = phases.init_run(cfg)
    from unirl_core.rollout.diffusion import TrainsideDiffusionEngine

    real = TrainsideDiffusionEngine.generate

    def shifted(self, batch, **kw):  # an engine that re-shifted the schedule and echoed what it used
        out = real(self, batch, **kw)
        for p in out.generated:
            p.segment.sigmas = p.segment.sigmas * 0.999
        return out

    monkeypatch.setattr(TrainsideDiffusionEngine, "generate", shifted)
    with pytest.raises(NumericsError, match="sigmas"):
        phases.rollout_phase(cfg, ckpt, step=1)


def test_train_refuses_a_batch_from_another_policy_version(tmp_path):
    cfg = _diffusion(tmp_path)
    ckpt = phases.init_run(cfg)
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    batch, _ = phases.advantage_phase(cfg, phases.reward_phase(cfg, batch)[0], ckpt)
    for p in batch.generated:
        p.policy_version = ckpt.policy_version - 1  # sampled by a version one behind the trainer
    # the configured bound and the observed lag, each under its own name
    with pytest.raises(NumericsError, match=r"policy lag \(synchronous loop\)=0: .*observed lag 1 "):
        phases.train_phase(cfg, batch, ckpt, step=1)


@pytest.mark.parametrize("where", ["echo", "pin and echo"])
def test_train_refuses_a_trajectory_whose_sigmas_changed_after_rollout(tmp_path, where):
    """Rollout's sigma_verify passed; the Part is changed afterwards by 1e-5 (well inside what a ratio check would
    let through). The trainer derives the schedule from the config again and refuses the batch before replaying."""
    cfg = _diffusion(tmp_path)
    ckpt = phases.init_run(cfg)
    batch, _ = phases.rollout_phase(cfg, ckpt, step=1)
    batch, _ = phases.advantage_phase(cfg, phases.reward_phase(cfg, batch)[0], ckpt)
    part = batch.generated[1]
    part.segment.sigmas = part.segment.sigmas.clone()
    part.segment.sigmas[3] += 1e-5
    if where == "pin and echo":
        part.sampling = dataclasses.replace(part.sampling, sigmas=tuple(float(v) for v in part.segment.sigmas))
    field = "segment.sigmas" if where == "echo" else "sampling.sigmas"
    with pytest.raises(NumericsError, match=rf"sample\[{part.sample_id}\]\.{field}="):
        phases.train_phase(cfg, batch, ckpt, step=1)
    assert phases.build.store(cfg).latest().step == 0  # nothing trained, nothing written


@pytest.mark.slow
def test_ema_rollout_samples_with_the_checkpoint_ema_weights(tmp_path):
    cfg = _diffusion(tmp_path, "train.ema_decay=0.5", "loop.total_steps=2")
    run_local(cfg)
    ckpt = phases.build.store(cfg).latest()
    policy_batch, _ = phases.rollout_phase(cfg, ckpt, step=3)
    ema_batch, _ = phases.rollout_phase(cfg, ckpt, step=3, weights="ema")
    assert all(p.policy_version == phases.EMA_POLICY_VERSION for p in ema_batch.generated)
    # same noise, other weights: other trajectories
    assert not torch.equal(policy_batch.generated[0].segment.latents, ema_batch.generated[0].segment.latents)
    with pytest.raises(ConfigError, match="ema_decay"):
        phases.rollout_phase(_diffusion(tmp_path), ckpt, step=3, weights="ema")


def test_lm_rollout_logs_the_decode_rescore_gap(tmp_path):
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=1"])
    hist = run_local(cfg)
    gap = hist[0]["rollout/decode_rescore_absdiff_max"]
    assert 0.0 <= gap < 1e-3  # fp32: KV-cache decode vs full forward differ only in reduction order


def test_default_recipe_samples_one_x_t_per_group_and_trains_the_first_steps(tmp_path):
    # shapes-flow-grpo-count's climb rests on these two settings: siblings start from one x_T (their rewards differ
    # only through the SDE steps the loss trains) and the 3 SDE steps start at denoising step 0 or 1.
    cfg = load_recipe("shapes-flow-grpo-count", [f"checkpoint.root={tmp_path}", "loop.total_steps=1", "eval=null",
                                                 "data.prompts_per_step=2", "data.samples_per_prompt=3",
                                                 "train.micro_batch_size=6", "diffusion.engine.forward_batch_size=6"])
    batch, _ = phases.rollout_phase(cfg, phases.init_run(cfg), step=1)
    groups: dict[str, list] = {}
    for p in batch.generated:
        groups.setdefault(p.group_id, []).append(p.segment)
    assert len(groups) == 2 and all(len(g) == 3 for g in groups.values())
    a, b = groups.values()
    assert not torch.equal(a[0].latents[0], b[0].latents[0])  # one x_T per group, not one per batch
    for segs in groups.values():
        assert all(torch.equal(s.latents[0], segs[0].latents[0]) for s in segs)
        assert not torch.equal(segs[0].latents[-1], segs[1].latents[-1])  # the SDE noise differs per sibling
        for s in segs:
            trained = s.sde_mask.nonzero().flatten().tolist()
            assert len(trained) == 3 and trained[0] in (0, 1) and trained == list(range(trained[0], trained[0] + 3))
