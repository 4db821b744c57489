"""Resume semantics: changed settings (applied or refused), finished runs, version paths, older versions and
forks, Ctrl-C - on short tiny-grpo runs."""

from __future__ import annotations

import json
import logging

import pytest
import safetensors.torch
import torch

from unirl_core.checkpoint import CheckpointStore, restore_train_checkpoint
from unirl_core.config import load_recipe
from unirl_core.errors import CheckpointError, ConfigError
from unirl_core.loop import resume
from unirl_core.runtime import build
from unirl_core.loop.local import run_local
from unirl_core.loop.phases import init_run
from unirl_core.train.backend import TrainBackend

RUN = "tiny-grpo"
SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8"]


def _cfg(root, steps: int, *extra: str):
    return load_recipe(RUN, [*SMALL, f"checkpoint.root={root}", f"loop.total_steps={steps}", *extra])


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _weights(root, run: str, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(f"{root}/{run}/step-{step:08d}/model.safetensors")


def _warnings(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_safe_override_applies_on_resume_and_reaches_the_optimizer(tmp_path, caplog):
    run_local(_cfg(tmp_path, 1))
    new = _cfg(tmp_path, 2, "train.lr=1e-3")
    # what train_phase does: the restored optimizer and schedule use the run's lr, not the checkpoint's
    backend = TrainBackend(build.fresh_bundle(new), build.algorithm(new), new.train)
    restore_train_checkpoint(backend, CheckpointStore(str(tmp_path), RUN).latest())
    assert [g["lr"] for g in backend.optimizer.param_groups] == [1e-3]
    assert [g["initial_lr"] for g in backend.optimizer.param_groups] == [1e-3]
    assert backend.scheduler.base_lrs == [1e-3] and backend.scheduler.get_last_lr() == [1e-3]

    with caplog.at_level(logging.WARNING):
        hist = run_local(new)
    assert [h["train/lr"] for h in hist] == [1e-3]
    assert "train.lr: 0.002 -> 0.001" in _warnings(caplog)
    run = tmp_path / RUN
    assert json.loads((run / "step-00000002" / "config.json").read_text())["train"]["lr"] == 1e-3
    start, event = json.loads((run / "history.json").read_text())
    assert start["event"] == "start" and start["threads"]["torch"] == torch.get_num_threads()
    assert event["event"] == "resume" and event["step"] == 1
    assert event["changes"] == {"loop.total_steps": [1, 2], "train.lr": [0.002, 0.001]}


@pytest.mark.parametrize("override, fix", [
    ("data.samples_per_prompt=2", "fork_as="),  # trajectory layout: only a fork may change it
    ("lm.sampling.max_new_tokens=3", "fork_as="),
    ("lm.model.tiny.hidden_size=32", "new run from scratch"),  # the weights would not fit
    ("train.seed=5", "restores the RNG state"),  # would have no effect on a resumed run
])
def test_layout_and_model_overrides_are_refused_on_resume(tmp_path, override, fix):
    run_local(_cfg(tmp_path, 1))
    key, new = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}=") as e:
        regeometry = ["train.micro_batch_size=4", "lm.engine.forward_batch_size=4"] if key.startswith("data") else []
        init_run(_cfg(tmp_path, 2, override, *regeometry))
    msg = str(e.value)
    assert new in msg and "step-00000001/config.json" in msg and fix in msg
    assert CheckpointStore(str(tmp_path), RUN).latest().step == 1  # nothing was written


def test_finished_run_says_how_to_extend_it(tmp_path, caplog, capsys):
    run_local(_cfg(tmp_path, 1))
    with caplog.at_level(logging.WARNING):
        assert run_local(_cfg(tmp_path, 1)) == []
    text = _warnings(caplog)
    assert "already complete" in text and "step 1" in text and "loop.total_steps=1" in text
    assert '"loop.total_steps=2"' in text and "name=<new name>" in text
    assert "already complete" in capsys.readouterr().err  # also on stderr (caplog's handler is not stderr)


def test_relative_and_trailing_slash_version_paths(tmp_path, monkeypatch):
    run_local(_cfg(tmp_path, 2))
    monkeypatch.chdir(tmp_path)
    latest = CheckpointStore(str(tmp_path), RUN).latest()
    for given in (f"{RUN}/step-00000002", f"{RUN}/step-00000002/", f"./{RUN}/step-00000002",
                  f"file://{tmp_path}/{RUN}/step-00000002/"):
        assert init_run(_cfg(tmp_path, 3), resume_from=given) == latest
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert init_run(_cfg(tmp_path, 3), resume_from=f"../{RUN}/step-00000002") == latest
    with pytest.raises(CheckpointError, match="resume_from='nope/step-00000002'.*resolved: "):
        init_run(_cfg(tmp_path, 3), resume_from="nope/step-00000002")
    assert resume.normalize_uri("s3://b/p/run/step-00000002/") == "s3://b/p/run/step-00000002"


def test_older_version_is_refused_and_a_fork_leaves_the_run_untouched(tmp_path, caplog):
    run_local(_cfg(tmp_path, 3))
    run = tmp_path / RUN
    step1 = str(run / "step-00000001")
    with pytest.raises(ConfigError, match=r"resume_from=.*steps \[2, 3\] after step 1") as e:
        run_local(_cfg(tmp_path, 3), resume_from=step1)
    assert "fork_as=" in str(e.value) and str(run / "step-00000003") in str(e.value)

    before = _files(run)
    with caplog.at_level(logging.WARNING):
        hist = run_local(_cfg(tmp_path, 3), resume_from=step1, fork_as="fork-b")
    assert [h["step"] for h in hist] == [2.0, 3.0]
    pins = {k: v for k, v in _files(run).items() if k.startswith("forks/")}
    assert {k: v for k, v in _files(run).items() if k not in pins} == before  # the original run: not a byte changed
    assert list(pins) == ["forks/fork-b.json"]  # but for the pin that keeps the version the fork references
    assert "forked run 'tiny-grpo' at step 1" in _warnings(caplog)
    fork = tmp_path / "fork-b"
    for step in (1, 3):  # the start version and every version trained from it carry the lineage
        lineage = json.loads((fork / f"step-{step:08d}" / "extra.json").read_text())["lineage"]
        assert lineage["parent_run"] == RUN and lineage["parent_uri"] == step1 and lineage["parent_step"] == 1
    assert json.loads((fork / "step-00000003" / "config.json").read_text())["name"] == "fork-b"
    # same settings from the same version: the fork retrains steps 2-3 bit-identically
    a, b = _weights(tmp_path, RUN, 3), _weights(tmp_path, "fork-b", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the same call again continues (here: finds complete) the fork; another run's name is refused
    assert run_local(_cfg(tmp_path, 3), resume_from=step1, fork_as="fork-b") == []
    with pytest.raises(ConfigError, match="fork_as='fork-b'.*not a fork of"):
        init_run(_cfg(tmp_path, 3), resume_from=str(run / "step-00000002"), fork_as="fork-b")
    with pytest.raises(ConfigError, match="fork_as='tiny-grpo'"):
        init_run(_cfg(tmp_path, 3), resume_from=step1, fork_as=RUN)


def test_fork_may_change_the_layout_and_records_it(tmp_path):
    run_local(_cfg(tmp_path, 1))
    over = ["data.samples_per_prompt=2", "train.micro_batch_size=4", "lm.engine.forward_batch_size=4"]
    hist = run_local(_cfg(tmp_path, 2, *over), fork_as="g2")
    assert [h["rollout/samples"] for h in hist] == [4.0]  # 2 prompts x 2 samples
    lineage = json.loads((tmp_path / "g2" / "step-00000001" / "extra.json").read_text())["lineage"]
    assert lineage["changes"]["data.samples_per_prompt"] == [4, 2]
    assert lineage["changes"]["train.micro_batch_size"] == [8, 4]
    with pytest.raises(ConfigError, match="lm.model.tiny.num_layers"):  # the model never changes
        init_run(_cfg(tmp_path, 2, "lm.model.tiny.num_layers=1"), fork_as="g3")


def test_unpublished_leftover_of_a_crash_is_still_resumed(tmp_path):
    run_local(_cfg(tmp_path, 2))
    store = CheckpointStore(str(tmp_path), RUN)
    store.publish(store.versions()[-2])  # as if the crash came between train (step 2 written) and publish
    assert init_run(_cfg(tmp_path, 2)).step == 1
    assert [h["step"] for h in run_local(_cfg(tmp_path, 2))] == [2.0]


def test_ctrl_c_says_what_was_published_and_how_to_resume(tmp_path, caplog, capsys):
    def interrupt(metrics, batch):
        if metrics["step"] == 2.0:
            raise KeyboardInterrupt

    with caplog.at_level(logging.WARNING), pytest.raises(KeyboardInterrupt):
        run_local(_cfg(tmp_path, 4), on_step=interrupt)
    text = _warnings(caplog)
    assert "interrupted: run 'tiny-grpo' last published step 2" in text
    assert str(tmp_path / RUN / "step-00000002") in text and "run_local(cfg)" in text
    assert "interrupted" in capsys.readouterr().err
    assert [h["step"] for h in run_local(_cfg(tmp_path, 4))] == [3.0, 4.0]


def test_resume_rules_name_every_config_section():
    keys = []

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                keys.append(f"{prefix}{k}")

    for recipe in ("tiny-grpo", "tiny-grpo-vllm", "tiny-flow-grpo"):
        walk(resume.config_json(load_recipe(recipe)))
    keys = [k for k in keys if k not in ("lm", "diffusion")]  # the other family's section (None)
    unlisted = [k for k in keys if not any(k == p or k.startswith(p + ".") for p in resume.RESUME_RULES)]
    assert unlisted == [], "classify these keys in resume.RESUME_RULES"
    rules = {k: resume.rule_for(k) for k in keys}
    assert rules["train.lr"] == rules["loop.total_steps"] == rules["checkpoint.keep_last"] == "apply"
    assert rules["data.samples_per_prompt"] == rules["train.micro_batch_size"] == "fork"
    assert rules["lm.model.dtype"] == rules["lm.model.finetune"] == rules["diffusion.model.lora.rank"] == "never"
    assert rules["diffusion.sampling.num_steps"] == rules["lm.engine.system_prompt"] == "fork"
    assert rules["name"] == rules["checkpoint.root"] == "ignore"


@pytest.mark.slow
def test_a_resume_applies_the_thread_count_the_run_started_with(tmp_path):
    """CPU float reductions depend on torch's thread count: a run records its count at its start and a resume
    sets it, so the resumed run is bit-exact with the uninterrupted one (tiny-flow-grpo resumed with 2 threads
    instead of 1 without it: weights differ by ~4e-4 after one step)."""
    from unirl_core.checkpoint import load_weights
    from unirl_core.runtime import build

    def cfg(root, steps):
        return load_recipe("tiny-flow-grpo", [f"checkpoint.root={root}", f"loop.total_steps={steps}", "eval=null",
                                              "report.tensorboard=false"])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = run_local(cfg(tmp_path / "whole", 3), progress=False)
        run_local(cfg(tmp_path / "cut", 2), progress=False)
        events = build.store(cfg(tmp_path / "cut", 3)).history()
        assert events[0]["event"] == "start" and events[0]["threads"]["torch"] == 1
        torch.set_num_threads(2)
        rest = run_local(cfg(tmp_path / "cut", 3), progress=False)
        assert torch.get_num_threads() == 1  # applied
        assert rest[-1]["train/loss"] == whole[-1]["train/loss"]
        a, b = (load_weights(build.store(cfg(tmp_path / r, 3)).latest()) for r in ("whole", "cut"))
        assert all(torch.equal(a[k], b[k]) for k in a)
    finally:
        torch.set_num_threads(before)
