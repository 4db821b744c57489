"""Replay: a step rebuilt from what the run stored is bitwise the step the run took (batch and version), on the
tiny diffusion (tiny-flow-grpo), LM (tiny-grpo) and agentic (tiny-agent-calc) recipes; a changed stored input fails naming the field; a run
that did not store enough fails naming what is missing and the setting that keeps it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_checkpoint
from unirl_core.checkpoint.batches import BatchStore
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.runs.replay import ReplayInputMissing, ReplayMismatch, replay

SMALL = {
    "tiny-flow-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=4",
                       "diffusion.engine.forward_batch_size=4", "diffusion.sampling.num_steps=4"],
    "tiny-grpo": ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
                  "lm.engine.forward_batch_size=8"],
    # the agentic family: multi-turn episodes against an environment (random-init model: no SFT export needed)
    "tiny-agent-calc": ["lm.model.model=tiny", "eval=null", "data.prompts_per_step=2", "data.samples_per_prompt=4",
                        "lm.engine.forward_batch_size=8", "train.micro_batch_size=8",
                        "lm.agent={env: {name: guess_number, high: 1000}, max_turns: 3, max_response_tokens: 64}"],
}
KEEP = ["checkpoint.keep_batches=true", "checkpoint.keep_every=1"]
STEPS = 4


def _run(root, recipe: str, *extra: str) -> str:
    cfg = load_recipe(recipe, [*SMALL[recipe], f"checkpoint.root={root}", f"loop.total_steps={STEPS}", *extra])
    run_local(cfg, progress=False)
    return f"{root}/{cfg.name}"


@pytest.fixture(scope="module", params=sorted(SMALL))
def kept_run(request, tmp_path_factory):
    """A 4-step run of each recipe that keeps every version and batch."""
    return request.param, _run(tmp_path_factory.mktemp(request.param), request.param, *KEEP)


def _tamper(run: str, step: int, change) -> BatchStore:
    """Rewrite step ``step``'s stored batch with ``change(part)`` applied to its first generated Part."""
    root, name = run.rsplit("/", 1)
    store = BatchStore(root, name)
    batch = store.load(step)
    change(batch.samples[0].parts[-1])
    store.save(step, batch)
    return store


@pytest.mark.slow
def test_three_steps_replay_bitwise(kept_run):
    recipe, run = kept_run
    for step in (1, 2, STEPS):
        report = replay(run, step=step)
        assert report.step == step and report.samples == 8
    assert not (Path(run) / "replay").exists()  # the replayed versions were written aside and removed


@pytest.mark.slow
def test_changed_stored_reward_names_reward(kept_run):
    recipe, run = kept_run
    original = BatchStore(*run.rsplit("/", 1)).load(2)
    store = _tamper(run, 2, lambda p: setattr(p, "reward", p.reward + 0.5))
    try:
        with pytest.raises(ReplayMismatch, match="field 'reward'") as err:
            replay(run, step=2)
        assert err.value.difference.field == "reward"
    finally:
        store.save(2, original)
    replay(run, step=2)  # the untouched batch replays again


@pytest.mark.slow
def test_changed_stored_prompt_or_advantage_names_the_field(kept_run):
    recipe, run = kept_run
    original = BatchStore(*run.rsplit("/", 1)).load(3)
    try:
        _tamper(run, 3, lambda p: setattr(p, "prompt", p.prompt + " (edited)"))
        with pytest.raises(ReplayMismatch, match="field 'prompt'"):
            replay(run, step=3)
        BatchStore(*run.rsplit("/", 1)).save(3, original)
        _tamper(run, 3, lambda p: setattr(p, "advantage", -p.advantage))
        with pytest.raises(ReplayMismatch, match="field 'advantage'"):
            replay(run, step=3)
    finally:
        BatchStore(*run.rsplit("/", 1)).save(3, original)


@pytest.mark.slow
def test_changed_stored_version_names_the_tensor(kept_run):
    recipe, run = kept_run
    root, name = run.rsplit("/", 1)
    store = CheckpointStore(root, name)
    ref = next(v for v in store.versions() if v.step == 2)
    loaded = load_checkpoint(ref)
    key = sorted(loaded.weights)[0]
    weights = dict(loaded.weights)
    weights[key] = weights[key].clone()
    weights[key].view(-1)[0] += torch.finfo(torch.float32).eps * 64 * max(1.0, abs(float(weights[key].view(-1)[0])))
    kw = dict(weights=weights, ema_weights=loaded.ema_weights, train_state=loaded.train_state, config=loaded.config,
              extra=loaded.extra, policy_version=ref.policy_version, meta=dict(loaded.manifest.meta), publish=False,
              overwrite=True)
    store.save(2, **kw)
    try:
        with pytest.raises(ReplayMismatch, match=re.escape(f"differs first in version 2 model.safetensors['{key}'] (value)")):
            replay(run, step=2)
    finally:
        store.save(2, **{**kw, "weights": loaded.weights})
    replay(run, step=2)


@pytest.mark.slow
def test_a_run_that_did_not_store_enough_says_what_and_which_setting(tmp_path):
    run = _run(tmp_path, "tiny-grpo")  # defaults: keep_last 3, no batches
    with pytest.raises(ReplayInputMissing, match=r"version 1 .*holds versions \[2, 3, 4\].*checkpoint.keep_every=1"):
        replay(run, step=1)  # retention pruned versions 0 and 1
    with pytest.raises(ReplayInputMissing, match=r"batch of step 4 .*checkpoint.keep_batches=true"):
        replay(run, step=4)
    with pytest.raises(ConfigError, match="newest version is 4"):
        replay(run, step=5)


def test_replay_refuses_step_zero_and_a_bad_run_path(tmp_path):
    with pytest.raises(ConfigError, match="step=0"):
        replay(f"{tmp_path}/x", step=0)
    with pytest.raises(ConfigError, match="holds none"):
        replay(f"{tmp_path}/x", step=1)


@pytest.mark.slow
def test_cli_replay_exit_status_and_rescore(kept_run, capsys):
    from unirl_core.runs.__main__ import main

    recipe, run = kept_run
    assert main(["replay", run, "--step", "1", "--step", "3"]) == 0
    assert capsys.readouterr().out.count("bitwise equal") == 2
    original = BatchStore(*run.rsplit("/", 1)).load(1)
    _tamper(run, 1, lambda p: setattr(p, "reward", p.reward - 1.0))
    try:
        assert main(["replay", run, "--step", "1"]) == 1
        assert "MISMATCH" in capsys.readouterr().err
    finally:
        BatchStore(*run.rsplit("/", 1)).save(1, original)
    scorer = {"tiny-flow-grpo": "jpeg_compressibility", "tiny-grpo": "toy_arithmetic"}.get(recipe, "agent_return")
    assert main(["rescore", run, "--reward", f"own={scorer}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| step | samples | run | own |") and "rescore.html" in out
    assert main(["replay", run, "--step", "9"]) == 2  # a step the run never trained: the error, no traceback
    assert "newest version is 4" in capsys.readouterr().err


D_SMALL = SMALL["tiny-flow-grpo"]
L_SMALL = SMALL["tiny-grpo"]
VARIANTS = {  # what a step can do beyond the plain loop, each replayed bitwise
    "tiny-dapo": L_SMALL,  # dynamic sampling: extra rollout rounds refill flat groups
    "tiny-nft": D_SMALL,  # DiffusionNFT: rollouts sample with the version's EMA weights
    "tiny-flow-grpo": [*D_SMALL, "loop.rollout_with_trainer=true",  # the trainer's module samples
                       "tracker={}"],  # Flow-GRPO's per-prompt stat tracker, carried in extra.json
    "tiny-cispo": L_SMALL, "tiny-mixgrpo": D_SMALL, "tiny-grpo-guard": D_SMALL, "tiny-flow-dppo": D_SMALL,
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(VARIANTS))
def test_algorithm_variants_replay_bitwise(tmp_path, recipe):
    cfg = load_recipe(recipe, [*VARIANTS[recipe], f"checkpoint.root={tmp_path}", "loop.total_steps=3", *KEEP,
                               "report.tensorboard=false"])
    run_local(cfg, progress=False)
    for step in (1, 3):
        assert replay(f"{tmp_path}/{cfg.name}", step=step).step == step
    if cfg.tracker is not None:  # the tracker state replay compared (version 3's extra.json) is really there
        last = CheckpointStore(str(tmp_path), cfg.name).latest()
        assert load_checkpoint(last).extra["tracker"]
