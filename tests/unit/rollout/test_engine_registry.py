"""Engines by name: a test module registers a toy dedicated engine and the loop runs steps with it - published
weights only, its log-probs checked against the trainer's replay - with no edit outside this file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from unirl_core.loop.executors import in_process
from unirl_core.checkpoint import load_weights
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local
from unirl_core.models.lm import LMConfig, load_lm
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.registry import engine_entry, engine_names, register_engine, unregister_engine
from unirl_core.runtime import build


@dataclass(frozen=True, kw_only=True)
class ToyEngineConfig:
    """What the loop asks of a dedicated engine's settings, and nothing else."""

    model: str = "tiny"
    tokenizer: str | None = None
    weight_sync: str = "reload"
    lora_alpha: float | None = None
    max_lora_rank: int = 16
    staging_dir: str | None = None


class ToyEngine:
    """An 'inference server' in this process: its own copy of the model, which only ever holds published weights."""

    instances: list[ToyEngine] = []

    def __init__(self, config: ToyEngineConfig, *, policy_version: int, tokenizer) -> None:
        self.config, self.policy_version, self.tokenizer = config, policy_version, tokenizer
        self.model = load_lm(LMConfig(model=config.model, finetune="full", keep_reference=False))
        self.generated, self.synced, self.closed = 0, [], False
        ToyEngine.instances.append(self)

    def update_weights(self, source, version: int) -> float:
        build.apply_policy_weights(self.model, load_weights(source), where=f"toy engine <- {source.uri}")
        self.policy_version = version
        self.synced.append(version)
        return 0.0

    def generate(self, request):
        seed = request.generated[0].sampling.seed % (2**31)  # the loop seeds a server's requests from the step
        for part in request.generated:
            part.sampling = dataclasses.replace(part.sampling, seed=None)
        engine = TrainsideAREngine(self.model, AREngineConfig(seed=seed), policy_version=self.policy_version)
        self.generated += 1
        return engine.generate(request)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def toy_engine():
    ToyEngine.instances.clear()
    register_engine("toy", config=ToyEngineConfig, build=ToyEngine)
    yield
    in_process().resources.close_engines()
    unregister_engine("toy")


TOY = ["lm.deployment.mode=separate", "lm.deployment.engine=toy", "lm.deployment.sync={method: reload}",
       "lm.dedicated_engine={model: tiny}", "train.old_logp_source=replay"]


def test_a_registered_engine_runs_steps_of_the_loop(tmp_path, toy_engine):
    torch.set_num_threads(1)
    assert "toy" in engine_names(dedicated=True) and engine_entry("toy").section == "lm.dedicated_engine"
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "loop.total_steps=2", "report.progress=false",
                                    "eval=null", *TOY])
    assert isinstance(cfg.lm.dedicated, ToyEngineConfig)
    history = run_local(cfg)
    (engine,) = ToyEngine.instances
    assert engine.generated == 2 and engine.synced == [0, 1]  # every rollout from the version just published
    for h in history:
        assert h["rollout/weight_synced"] == 1.0
        assert h["rollout/logp_absdiff_max"] == 0.0  # the same model and kernels as the trainer's replay
        assert h["train/ratio_mean"] == 1.0
    assert any(h["train/grad_norm"] > 0 for h in history)


def test_a_toy_engine_setting_is_parsed_by_its_config_and_wrong_ones_name_the_field(tmp_path, toy_engine):
    base = [f"checkpoint.root={tmp_path}", *TOY[:-2], "train.old_logp_source=replay"]
    with pytest.raises(ConfigError, match=r"lm\.dedicated_engine\.speed"):
        load_recipe("tiny-grpo", [*base, "lm.dedicated_engine={speed: 3}"])
    with pytest.raises(ConfigError, match=r"lm\.dedicated_engine=.*unset with lm.deployment.engine='trainside'"):
        load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "lm.dedicated_engine={model: tiny}"])
    with pytest.raises(ConfigError, match=r"lm\.dedicated_engine.weight_sync='lora'"):
        load_recipe("tiny-grpo", [*base, "lm.dedicated_engine={weight_sync: lora}"])


def test_an_unknown_engine_names_the_registered_ones(tmp_path, toy_engine):
    with pytest.raises(ConfigError, match=r"deployment\.engine='tgi': expected one of .*'toy'.*register_engine"):
        load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", "lm.deployment.mode=separate",
                                  "lm.deployment.engine=tgi", "lm.deployment.sync={method: reload}"])
