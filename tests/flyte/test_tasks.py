"""Task-level behaviour that needs no workflow: transient-failure classification, shard metrics, accelerators."""

from __future__ import annotations

import socket

import pytest
from flytekit.exceptions.user import FlyteRecoverableException

from tasks.common import _accelerator_from_env, is_transient, phase
from unirl_core.loop.metrics import merge_shard_metrics
from unirl_core.errors import ConfigError, RewardError
from unirl_core.reward.client import RemoteRewardClient


def _client_error_against_a_silent_server() -> RewardError:
    """The real client against a server that accepts connections and never answers (a hung scorer)."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        client = RemoteRewardClient(f"http://127.0.0.1:{srv.getsockname()[1]}", token=None, timeout_s=0.2, retries=1,
                              backoff_s=0.01)
        with pytest.raises(RewardError, match="ReadTimeout") as info:
            client._post_with_retries(b"x")
    return info.value


def test_reward_server_timeout_is_recoverable():
    err = _client_error_against_a_silent_server()
    assert is_transient(err)
    metrics: dict[str, float] = {}
    with pytest.raises(FlyteRecoverableException, match="reward: transient"):
        with phase("reward", metrics):
            raise err


def test_input_errors_are_not_retried():
    assert not is_transient(RewardError("reward server http://x refused the request (HTTP 401: no)"))
    assert not is_transient(ConfigError("train.lr=-1: expected > 0"))
    with pytest.raises(ConfigError):
        with phase("train", {}):
            raise ConfigError("bad")
    try:
        raise RewardError("scorer failed") from TimeoutError("read timed out")
    except RewardError as e:
        assert is_transient(e)


def test_phase_records_compute_time():
    metrics: dict[str, float] = {}
    with phase("advantage", metrics):
        pass
    assert set(metrics) == {"time/advantage"} and metrics["time/advantage"] >= 0


def test_shard_metrics_merge():
    got = merge_shard_metrics([{"rollout/samples": 8.0, "time/rollout": 1.0, "rollout/seconds": 0.9,
                                "rollout/tokens_per_s": 10.0},
                               {"rollout/samples": 8.0, "time/rollout": 3.0, "rollout/seconds": 2.9,
                                "rollout/tokens_per_s": 30.0}])
    assert got == {"rollout/samples": 16.0, "time/rollout": 3.0, "rollout/seconds": 2.9, "rollout/tokens_per_s": 20.0}


def test_accelerator_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("UNIRL_ACCELERATOR", "h100")
    assert _accelerator_from_env().to_flyte_idl().device == "nvidia-h100"
    monkeypatch.setenv("UNIRL_ACCELERATOR", "a100")
    with pytest.raises(ConfigError, match="UNIRL_ACCELERATOR"):
        _accelerator_from_env()


def test_every_task_types_config_and_batches_with_our_transformers():
    import workflows.grpo  # noqa: F401  (defines every task)
    from flytekit.core.base_task import PythonTask
    from tasks import advantage, publish, report, reward, rollout, setup, train
    from tasks.run_types import RUN_CONFIG_META
    from tasks.types import ARROW_IPC_FORMAT

    seen = 0
    for mod in (advantage, publish, report, reward, rollout, setup, train):
        for obj in vars(mod).values():
            if not isinstance(obj, PythonTask):
                continue
            ins = obj.interface.inputs
            if "cfg" in ins:
                assert ins["cfg"].type.metadata == RUN_CONFIG_META, obj.name
                seen += 1
            if "batch" in ins:
                assert ins["batch"].type.blob.format == ARROW_IPC_FORMAT, obj.name
    assert seen >= 10


def test_shard_metrics_take_the_max_of_maxima():
    got = merge_shard_metrics([{"rollout/logp_absdiff_max": 1e-3, "rollout/logp_absdiff_mean": 1e-4,
                                "train/ratio_min": 0.99},
                               {"rollout/logp_absdiff_max": 4e-3, "rollout/logp_absdiff_mean": 3e-4,
                                "train/ratio_min": 0.98}])
    assert got == pytest.approx({"rollout/logp_absdiff_max": 4e-3, "rollout/logp_absdiff_mean": 2e-4,
                                 "train/ratio_min": 0.98}, rel=1e-12)
    assert got["rollout/logp_absdiff_max"] == 4e-3  # the max itself, not a blend


def test_one_shard_rollout_task_gives_what_the_map_and_join_give(monkeypatch):
    """``loop.rollout_shards == 1`` wires ``rollout_one_task``, not the map task + join: same batch, same metrics."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from tasks import rollout
    from tests.flyte.test_report import _batch

    def fake_rollout_phase(cfg, ckpt, *, step, shard, num_shards):
        b = _batch(step)
        b.metadata.update({"run": "r", "step": str(step), "shard": str(shard)})
        return b, {"rollout/samples": float(len(b)), "rollout/seconds": 0.25}

    @contextmanager
    def fixed_phase(name, metrics):
        yield
        metrics[f"time/{name}"] = 0.5

    monkeypatch.setattr(rollout, "phases", SimpleNamespace(rollout_phase=fake_rollout_phase), raising=False)
    monkeypatch.setattr(rollout, "phase", fixed_phase)
    monkeypatch.setattr(rollout, "deck", lambda name, page: None)
    one = rollout.rollout_one_task.task_function(cfg=None, ckpt=None, step=3)
    shard = rollout.rollout_task.task_function(cfg=None, ckpt=None, step=3, num_shards=1, shard=0)
    assert rollout.SHARD_METRICS_KEY in shard.metadata
    joined = rollout.join_shards_task.task_function(shards=[shard])
    assert one.metrics == joined.metrics == {"rollout/samples": 4.0, "rollout/seconds": 0.25, "time/rollout": 0.5}
    assert one.batch.metadata == joined.batch.metadata == {"run": "r", "step": "3"}
    assert [s.sample_id for s in one.batch] == [s.sample_id for s in joined.batch]
    assert [s.generated.reward for s in one.batch] == [s.generated.reward for s in joined.batch]
