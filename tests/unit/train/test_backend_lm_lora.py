"""Trainable-only checkpoints of a LoRA LM hold the adapters and nothing frozen (tied lm_head included)."""

import torch

from unirl_core.algorithms.grpo import GRPO
from unirl_core.models.lm import LMConfig, load_lm
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig


def test_lora_weights_leave_out_frozen_tied_head():
    bundle = load_lm(LMConfig(finetune="lora", lora_rank=4))
    module = bundle.module
    assert module.get_output_embeddings().weight is module.get_input_embeddings().weight  # tied preset
    weights = TrainBackend(bundle, GRPO(), TrainConfig()).model_state_dict()
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert set(weights) == trainable and all("lora_" in n for n in weights)
    assert all(isinstance(v, torch.Tensor) for v in weights.values())
