"""The compute-matched algorithm comparison: every cell's run config is its shipped recipe's algorithm on the common
curriculum, and the table's numbers and hacking flag come from the cell as measured."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import bench_algo_compare as bac  # noqa: E402


@pytest.mark.parametrize("algo, name", [("flow_grpo", "flow_grpo"), ("mixgrpo", "flow_grpo"),
                                        ("grpo_guard", "grpo_guard"), ("flow_dppo", "flow_dppo"), ("nft", "nft"),
                                        ("elbo_pg", "elbo_pg")])
def test_each_cell_trains_its_algorithm_on_the_common_curriculum(algo, name, tmp_path):
    cfg = bac.run_config(algo, 3, str(tmp_path), mix_interval=2)
    assert cfg.diffusion.algorithm.name == name
    assert list(cfg.data.prompts) == bac.CURRICULUM
    assert (cfg.data.prompts_per_step, cfg.data.samples_per_prompt) == (4, 8)
    assert cfg.diffusion.model.source == "shapes-sd3"  # the same warm start
    assert cfg.loop.seed == 3 and cfg.loop.total_steps == bac.MAX_STEPS
    assert cfg.checkpoint.keep_batches  # the hacking check re-scores the stored batches
    assert not cfg.eval.due(0, cfg.loop.total_steps)  # evaluated after the budget, outside it
    window = cfg.diffusion.sampling.sde_window_shift_interval
    assert window == (2 if algo == "mixgrpo" else None)


def _cell(rewards, first, last, start=0.1, end=0.2):
    return {"algo": "x", "seed": 0, "steps": len(rewards), "cpu_s": 60.0,
            "curve": [{"reward": r, "cpu_s": 10.0 * (i + 1)} for i, r in enumerate(rewards)],
            "eval": {"start": start, "end": end}, "rescore": {"first": first, "last": last}}


def test_summary_flags_a_training_reward_up_while_the_strict_score_falls():
    up = bac.summarize(_cell([0.1, 0.2, 0.3, 0.4, 0.5], {"train": 0.2, "strict": 0.3}, {"train": 0.6, "strict": 0.1}))
    assert up["hacking"] and up["d_train"] == pytest.approx(0.4) and up["d_strict"] == pytest.approx(-0.2)
    assert up["train_first"] == pytest.approx(0.2) and up["train_final"] == pytest.approx(0.4)
    both = bac.summarize(_cell([0.5, 0.4, 0.3], {"train": 0.6, "strict": 0.3}, {"train": 0.4, "strict": 0.1}))
    assert not both["hacking"]  # both fell: a worse policy, not a loophole
