"""``train.micro_batch_tokens`` through the shipped loop: exact first updates, and config errors naming the field."""

import pytest
import torch

from tests.unit.loop.test_exactness_matrix import STEPS, assert_exact
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError
from unirl_core.loop.local import run_local


def test_token_budget_loop_is_exact_in_bf16(tmp_path):
    torch.set_num_threads(1)
    cfg = load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", f"loop.total_steps={STEPS}",
                                    "lm.model.dtype=bfloat16", "lm.sampling.max_new_tokens=12",
                                    "lm.sampling.stop=[' ']", "train.micro_batch_tokens=96",
                                    "lm.engine.decode_batch_size=32"])
    history = run_local(cfg, progress=False)
    assert_exact(history)
    assert max(h["train/response_len_mean"] for h in history) < 12  # ragged: stop strings end rows early


@pytest.mark.parametrize("changes, field", [
    (["train.micro_batch_tokens=64", "lm.engine.micro_batch_tokens=64"], "lm.engine.micro_batch_tokens"),
    (["train.micro_batch_tokens=64", "loop.rollout_shards=2"], "loop.rollout_shards"),
])
def test_config_errors_name_the_field(tmp_path, changes, field):
    with pytest.raises(ConfigError, match=field):
        load_recipe("tiny-grpo", [f"checkpoint.root={tmp_path}", *changes])


def test_diffusion_refuses_a_token_budget(tmp_path):
    with pytest.raises(ConfigError, match="train.micro_batch_tokens"):
        load_recipe("tiny-flow-grpo", [f"checkpoint.root={tmp_path}", "train.micro_batch_tokens=64"])
