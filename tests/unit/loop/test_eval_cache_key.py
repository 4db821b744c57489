"""Review findings: settings that change what an evaluation computes from the same weights must change its cache
key (``eval_cache.protocol``), else a fork that changed them (their resume rule lets a fork or a resume change them)
is handed its parent's numbers for its start version."""

from __future__ import annotations

from unirl_core.config import load_recipe
from unirl_core.loop.eval_cache import digest_of, protocol
from unirl_core.loop.resume import RESUME_RULES

SMALL = ["data.prompts_per_step=2", "data.samples_per_prompt=4", "train.micro_batch_size=8",
         "lm.engine.forward_batch_size=8", "report.tensorboard=false", "eval.num_prompts=3"]


def _proto(recipe: str, *extra: str) -> str:
    cfg = load_recipe(recipe, [*SMALL, *extra])
    return digest_of(protocol(cfg, [], "policy"))


def test_agent_settings_are_in_the_eval_key():
    # generate_lm runs the eval's episodes with cfg.lm.agent (environment, turn limits); a fork may change it
    assert RESUME_RULES["lm.agent"] == "fork"
    assert _proto("tiny-agent-calc", "lm.model.model=tiny") != \
        _proto("tiny-agent-calc", "lm.model.model=tiny", "lm.agent.max_turns=1")


def test_overlong_shaping_is_in_the_eval_key():
    # reward_phase -> shape_rewards adds DAPO's overlong penalty to every eval sample's reward (and its
    # eval/reward/overlong_* metrics) from lm.algorithm, which a resume may change ("apply")
    assert RESUME_RULES["lm.algorithm"] == "apply"
    assert _proto("tiny-grpo") != _proto("tiny-grpo", "lm.algorithm.overlong_buffer_len=4")


def test_a_changed_source_file_changes_the_eval_key(tmp_path, monkeypatch):
    # a scorer's bugfix under a long-lived root must not be answered with the number the old code produced
    from unirl_core.loop import eval_cache

    plugin = tmp_path / "evkey_plugin"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("def score(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eval_cache.code_digest.cache_clear()
    before = eval_cache.code_digest(("evkey_plugin",))
    assert before != eval_cache.code_digest(())  # the plugin's files are in it
    (plugin / "__init__.py").write_text("def score(x):\n    return x + 1\n")
    eval_cache.code_digest.cache_clear()
    assert eval_cache.code_digest(("evkey_plugin",)) != before
    eval_cache.code_digest.cache_clear()


def test_an_entry_without_metrics_is_a_miss(tmp_path):
    from unirl_core.loop.eval_cache import EvalCache

    cache = EvalCache(str(tmp_path))
    (tmp_path / ".evals").mkdir()
    (tmp_path / ".evals" / "k.json").write_text('{"key": "k"}')
    assert cache.get("k") is None
