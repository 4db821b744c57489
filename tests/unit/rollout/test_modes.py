"""Deployment-mode validation: every wrong mode / engine / sync combination fails with a clear error."""

import pytest

from unirl_core.errors import ConfigError
from unirl_core.rollout.modes import DeploymentConfig, SyncConfig, needs_sleep


def test_valid_combinations():
    assert not needs_sleep(DeploymentConfig(mode="direct", engine="trainside"))
    assert not needs_sleep(DeploymentConfig(mode="separate", engine="vllm", sync=SyncConfig()))
    assert needs_sleep(DeploymentConfig(mode="colocate", engine="sglang", sync=SyncConfig(method="lora"),
                                        sleep_level=2))


@pytest.mark.parametrize("kwargs, field, hint", [
    ({"mode": "direct", "engine": "trainside", "sync": SyncConfig()}, "deployment.sync", "remove the sync block"),
    ({"mode": "direct", "engine": "vllm"}, "deployment.engine", "mode='separate' or 'colocate'"),
    ({"mode": "separate", "engine": "vllm"}, "deployment.sync", "add sync=SyncConfig"),
    ({"mode": "colocate", "engine": "sglang"}, "deployment.sync", "add sync=SyncConfig"),
    ({"mode": "separate", "engine": "trainside", "sync": SyncConfig()}, "deployment.engine", "mode='direct'"),
    ({"mode": "colocate", "engine": "vllm", "sync": SyncConfig(), "sleep_level": 3}, "deployment.sleep_level",
     "use 1"),
    ({"mode": "remote", "engine": "vllm", "sync": SyncConfig()}, "deployment.mode", "'separate' or 'colocate'"),
    ({"mode": "separate", "engine": "tgi", "sync": SyncConfig()}, "deployment.engine", "pick an engine"),
    ({"mode": "separate", "engine": "vllm", "sync": {"method": "reload"}}, "deployment.sync", "SyncConfig"),
])
def test_invalid_combinations_name_the_field(kwargs, field, hint):
    with pytest.raises(ConfigError) as e:
        DeploymentConfig(**kwargs)
    assert str(e.value).startswith(field) and hint in str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"method": "nccl"}, "sync.method"),
    ({"every_n_steps": 0}, "sync.every_n_steps"),
    ({"every_n_steps": 4, "max_policy_lag": 2}, "sync.max_policy_lag"),
])
def test_sync_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        SyncConfig(**kwargs)
