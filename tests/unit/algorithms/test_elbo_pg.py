"""ELBO policy gradient: golden tests against our own transcription of arXiv 2602.04663 (as the authors' code
computes it), and the algorithm on tiny SD3.

Transcription (rectified flow; one pair (t, eps) of one sample, means over the latent's N elements):
    x_t = (1 - t) x0 + t eps,   x0_hat = x_t - t v,   d = x0_hat - x0 (= t ((eps - x0) - v))
    ELBO_velocity = -mean (v - (eps - x0))^2
    ELBO_x0       = -mean d^2
    ELBO_adaptive = -mean d^2 / s,   s = mean |d| held constant (no gradient)  =>  dELBO/dv = 2 t d / (N s)
    log r = ELBO_new - ELBO_old (ELBO_new detached),  r = exp(log r)
    EPG  = -r A ELBO_new                         dEPG/dELBO_new  = -r A
    PEPG = -r (A - log r) ELBO_new               dPEPG/dELBO_new = -r (A - log r)
    PAR  = 1/2 r (A - (ELBO_new - ELBO_old))^2   dPAR/dELBO_new  = -r (A - log r)   (the same as PEPG's)
"""

import math

import pytest
import torch

from unirl_core.algorithms.elbo_pg import (
    ELBOPGConfig,
    ELBOPolicyGradient,
    elbo_estimate,
    elbo_pg_per_entry,
    estimator_draws,
)
from unirl_core.algorithms.registry import algorithm_names
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError, InvariantError, NumericsError
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig, stack_conditions
from unirl_core.rollout.diffusion import DiffusionEngineConfig, TrainsideDiffusionEngine
from unirl_core.sde import flow_sigmas
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import DiffusionSamplingParams, NoiseRecipe, PromptRecord, SampleBatch

torch.set_num_threads(1)

X0, EPS, V, T = torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 1.0]]), torch.tensor([[1.0, 0.0]]), 0.25


def test_elbo_weightings_golden_hand_computed():
    # x_t = 0.75 [2, -1] + 0.25 [0.5, 1] = [1.625, -0.5];  x0_hat = x_t - 0.25 [1, 0] = [1.375, -0.5]
    # d = [-0.625, 0.5];  mean d^2 = (0.390625 + 0.25) / 2 = 0.3203125;  mean |d| = 0.5625
    # eps - x0 = [-1.5, 2];  v - (eps - x0) = [2.5, -2];  mean^2 = (6.25 + 4) / 2 = 5.125 (and 0.25^2 * 5.125 = 0.3203125)
    t = torch.tensor([[T]])
    torch.testing.assert_close(elbo_estimate(V, X0, EPS, t, "velocity"), torch.tensor([-5.125]))
    torch.testing.assert_close(elbo_estimate(V, X0, EPS, t, "x0"), torch.tensor([-0.3203125]))
    torch.testing.assert_close(elbo_estimate(V, X0, EPS, t, "adaptive"), torch.tensor([-0.3203125 / 0.5625]))


def test_adaptive_weight_is_held_constant_in_the_gradient():
    v = V.clone().requires_grad_(True)
    elbo_estimate(v, X0, EPS, torch.tensor([[T]]), "adaptive").sum().backward()
    d = torch.tensor([[-0.625, 0.5]])
    torch.testing.assert_close(v.grad, 2 * T * d / (2 * 0.5625))


def test_objectives_golden_values_and_gradients():
    old, adv = torch.tensor([-1.1, -2.0]), torch.tensor([1.0, -0.5])
    e = math.exp(0.1)
    want = {"epg": ([e, -1.0], [-e, 0.5]),
            "pepg": ([0.9 * e, -1.0], [-0.9 * e, 0.5]),
            "par": ([0.5 * e * 0.81, 0.5 * 0.25], [-0.9 * e, 0.5])}
    for objective, (value, grad) in want.items():
        new = torch.tensor([-1.0, -2.0], requires_grad=True)
        per, ratio = elbo_pg_per_entry(new, old, adv, objective)
        torch.testing.assert_close(ratio, torch.tensor([e, 1.0]))
        torch.testing.assert_close(per, torch.tensor(value))
        per.sum().backward()
        torch.testing.assert_close(new.grad, torch.tensor(grad), msg=objective)


def test_draws_depend_only_on_the_initial_noise_and_the_seed():
    x_T = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = ELBOPGConfig()
    levels, eps = estimator_draws(x_T, 10, cfg)
    assert levels.shape == (9,) and eps.shape == (9, 4, 8, 8) and eps.dtype == torch.float32
    assert len(set(levels.tolist())) == 9 and all(0 <= k < 10 for k in levels.tolist())  # without replacement
    again = estimator_draws(x_T.clone(), 10, cfg)
    assert torch.equal(levels, again[0]) and torch.equal(eps, again[1])
    assert not torch.equal(eps, estimator_draws(x_T, 10, ELBOPGConfig(seed=1))[1])
    assert not torch.equal(eps, estimator_draws(x_T + 1e-3, 10, cfg)[1])
    two = estimator_draws(x_T, 4, ELBOPGConfig(timestep_fraction=0.5, noise_draws=2))[0]
    assert two.shape == (4,) and two[0] == two[1] and two[2] == two[3] and two[0] != two[2]  # level-major pairs
    assert estimator_draws(x_T, 4, ELBOPGConfig(timestep_fraction=0.1))[0].shape == (1,)  # at least one level


@pytest.mark.parametrize("kw, fld", [
    ({"objective": "ppo"}, "elbo_pg.objective"), ({"weighting": "snr"}, "elbo_pg.weighting"),
    ({"timestep_fraction": 0.0}, "elbo_pg.timestep_fraction"), ({"noise_draws": 0}, "elbo_pg.noise_draws"),
    ({"advantage_scale": 0.0}, "elbo_pg.advantage_scale"), ({"adv_clip_max": -1.0}, "elbo_pg.adv_clip_max"),
    ({"kl_beta": -1.0}, "elbo_pg.kl_beta"), ({"old_policy": "ref"}, "elbo_pg.old_policy"),
    ({"old_logp_source": "rollout"}, "elbo_pg.old_logp_source"), ({"replay_batch_size": 0}, "elbo_pg.replay_batch_size"),
    ({"elbo_tolerance": -1.0}, "elbo_pg.elbo_tolerance"),
])
def test_bad_knob_names_the_field(kw, fld):
    with pytest.raises(ConfigError, match=fld) as info:
        ELBOPGConfig(**kw)
    assert str(kw[next(iter(kw))]) in str(info.value)
    assert "elbo_pg" in algorithm_names("diffusion")


def test_recipe_knobs_are_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"diffusion.algorithm.objective|elbo_pg.objective"):
        load_recipe("shapes-elbo-pg", ["diffusion.algorithm.objective=ppo"])
    with pytest.raises(ConfigError, match=r"clip_range.*belongs to"):
        load_recipe("shapes-elbo-pg", ["diffusion.algorithm.clip_range=0.2"])
    with pytest.raises(ConfigError, match="old_logp_source"):
        load_recipe("shapes-elbo-pg", ["train.old_logp_source=rollout"])
    cfg = load_recipe("shapes-elbo-pg", [f"checkpoint.root={tmp_path}"])
    assert isinstance(cfg.diffusion.algorithm, ELBOPGConfig) and cfg.diffusion.sampling.sde_type == "ode"


def _rollout(n_prompts=2, per=4, steps=4, guidance=1.0, seed=3):
    torch.manual_seed(0)
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="full"))
    eng = TrainsideDiffusionEngine(bundle, DiffusionEngineConfig(forward_batch_size=4, decode_media=False))
    sp = DiffusionSamplingParams(sigmas=flow_sigmas(num_steps=steps), sde_type="ode", guidance_scale=guidance,
                                 height=32, width=32)
    prompts = [PromptRecord(prompt_id=f"p{i}", prompt=f"prompt {i}") for i in range(n_prompts)]
    batch = eng.generate(SampleBatch.from_prompts(prompts, samples_per_prompt=per, kind="diffusion", sampling=sp),
                         noise=NoiseRecipe(base_seed=seed))
    for j, s in enumerate(batch):
        s.generated.advantage = float(j % 3) - 1.0
    return bundle, batch


def test_old_elbo_is_the_transcribed_estimator_of_the_conditional_velocity():
    bundle, batch = _rollout(guidance=3.0)  # a CFG rollout: the estimator still uses the conditional velocity
    cfg = ELBOPGConfig(weighting="adaptive", timestep_fraction=0.5, noise_draws=2)
    old = ELBOPolicyGradient(cfg).old_log_probs(bundle, batch)
    assert old.shape == (8, 4)
    seg, part = batch.generated[5].segment, batch.generated[5]
    levels, eps = estimator_draws(seg.latents[0], 4, cfg)
    sig, x0 = seg.sigmas[levels], seg.latents[-1].float()
    want = []
    with torch.no_grad():
        for j in range(4):
            t = float(sig[j])
            x_t = (1 - t) * x0 + t * eps[j]
            v = bundle.guided_velocity(x_t[None], sig[j:j + 1], stack_conditions([part.conditions], bundle.device),
                                       guidance_scale=1.0)[0]
            d = (x_t - t * v) - x0
            want.append(-(d ** 2).mean() / d.abs().mean())
    torch.testing.assert_close(old[5], torch.stack(want), rtol=1e-5, atol=1e-6)


def _drain(gen):
    while True:
        try:
            yield next(gen)
        except StopIteration as stop:
            return stop.value


def test_first_update_ratio_is_exactly_one_terms_add_up_and_gradient_flows():
    bundle, batch = _rollout()
    algo = ELBOPolicyGradient(ELBOPGConfig(replay_batch_size=3, timestep_fraction=0.75, kl_beta=0.1))
    old = algo.old_log_probs(bundle, batch)
    assert torch.equal(old, algo.old_log_probs(bundle, batch))  # the draws are seeded: a replay is bitwise
    out = algo.loss(bundle, batch, old_log_probs=old, first_update=True)
    m = out.metrics
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["elbo_absdiff_max"] == 0.0
    assert m["kl"] == 0.0 and m["trained_pairs"] == 3.0 and math.isfinite(out.loss.item())
    assert algo.num_loss_terms(batch) == 3 * 3
    terms = list(_drain(algo.loss_terms(bundle, batch, old_log_probs=old)))
    assert len(terms) == 9 and float(sum(t.detach() for t in terms)) == pytest.approx(float(out.loss.detach()), rel=1e-6)
    out.loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in bundle.module.parameters())


def test_after_a_step_the_ratio_moves_and_the_first_update_check_fails_closed():
    bundle, batch = _rollout()
    algo = ELBOPolicyGradient(ELBOPGConfig())
    old = algo.old_log_probs(bundle, batch)
    algo.loss(bundle, batch, old_log_probs=old).loss.backward()
    with torch.no_grad():
        for p in bundle.module.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad.sign()
    m = algo.loss(bundle, batch, old_log_probs=old).metrics
    assert m["elbo_absdiff_max"] > 0.0 and (m["ratio_min"] < 1.0 or m["ratio_max"] > 1.0)
    with pytest.raises(NumericsError, match="ELBO_theta - ELBO_old"):
        algo.loss(bundle, batch, old_log_probs=old, first_update=True)


def test_missing_or_mismatched_old_elbo_fails_with_the_fix():
    bundle, batch = _rollout(n_prompts=1)
    algo = ELBOPolicyGradient(ELBOPGConfig())
    with pytest.raises(InvariantError, match="old_logp_source: replay"):
        algo.loss(bundle, batch, old_log_probs=None)
    with pytest.raises(InvariantError, match="shape"):
        algo.loss(bundle, batch, old_log_probs=torch.zeros(4, 1))


def _train_once():
    bundle, batch = _rollout()
    backend = TrainBackend(bundle, ELBOPolicyGradient(ELBOPGConfig()),
                           TrainConfig(lr=1e-2, micro_batch_size=4, old_logp_source="replay"))
    before = [p.detach().clone() for p in bundle.module.parameters()]
    out = backend.step(batch)
    return before, [p.detach().clone() for p in bundle.module.parameters()], out


def test_backend_step_moves_weights_on_policy_and_a_replay_is_bitwise():
    before, after, out = _train_once()
    assert out.metrics["ratio_min"] == 1.0 and out.metrics["ratio_max"] == 1.0  # first update, exactly
    assert math.isfinite(out.loss) and any(not torch.equal(a, b) for a, b in zip(before, after))
    _, again, out2 = _train_once()
    assert all(torch.equal(a, b) for a, b in zip(after, again)) and out2.loss == out.loss


def test_sd35m_recipe_parses_and_passes_preflight_at_its_shape(tmp_path):
    from unirl_core.config.preflight import preflight

    prompts = tmp_path / "train.jsonl"  # the recipe's prompt file is the user's (the data check reads its head)
    prompts.write_text("".join(f'{{"prompt": "a photo of {i} cats"}}\n' for i in range(64)))
    cfg = load_recipe("sd35m-elbo-pg", [f"checkpoint.root={tmp_path}", f"data.file.path={prompts}"])
    algo = cfg.diffusion.algorithm
    assert isinstance(algo, ELBOPGConfig) and algo.objective == "pepg" and algo.timestep_fraction == 0.99
    assert cfg.diffusion.sampling.sde_type == "ode" and cfg.diffusion.sampling.guidance_scale == 1.0
    assert algo.pairs_per_sample(cfg.diffusion.sampling.num_steps) == 9
    notes = preflight(cfg, network=False)  # the hub is not asked here; the root is probed
    assert notes and "hub check skipped" in notes[0]


SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "diffusion.engine.forward_batch_size=8",
         "train.micro_batch_size=8", "diffusion.sampling.num_steps=4", "eval.samples_per_prompt=1",
         "report.tensorboard=false", "loop.total_steps=2"]


@pytest.mark.slow  # two whole runs of the recipe: ~12 s of CPU (docs/testing.md tiers)
def test_shapes_recipe_runs_through_the_loop_with_policy_or_ema_rollouts(tmp_path):
    from unirl_core.loop import phases
    from unirl_core.loop.local import run_local

    cfg = load_recipe("shapes-elbo-pg", [f"checkpoint.root={tmp_path}/a", *SMALL, "diffusion.algorithm.old_policy=policy",
                                         "train.ema_decay=null", "eval.weights=policy"])
    seen = []
    hist = run_local(cfg, progress=False, on_step=lambda m, b: seen.append(b))
    assert not any(bool(p.segment.sde_mask.any()) for b in seen for p in b.generated)  # ODE rollouts
    assert all(h["train/ratio_min"] == 1.0 == h["train/ratio_max"] for h in hist)  # one update a batch: exact
    assert all(h["train/elbo_absdiff_max"] == 0.0 and h["train/grad_norm"] > 0 for h in hist)
    with pytest.raises(ConfigError, match="train.ema_decay"):
        load_recipe("shapes-elbo-pg", ["diffusion.algorithm.old_policy=ema", "train.ema_decay=null"])
    ema = load_recipe("shapes-elbo-pg", [f"checkpoint.root={tmp_path}/b", *SMALL, "diffusion.algorithm.old_policy=ema",
                                         "train.ema_decay=0.5", "eval.weights=ema"])
    seen.clear()
    hist = run_local(ema, progress=False, on_step=lambda m, b: seen.append(b))
    assert [p.policy_version for p in seen[0].generated] == [phases.EMA_POLICY_VERSION] * 8
    assert hist[0]["train/elbo_absdiff_max"] == 0.0  # step 1: the EMA equals the weights
    assert hist[1]["train/elbo_absdiff_max"] > 0.0  # then ELBO_old is the lagging EMA's: the ratio moves
