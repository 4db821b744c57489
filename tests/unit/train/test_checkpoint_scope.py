"""LoRA checkpoints of SD3 hold exactly the trainable parameters: no buffers (pos_embed), nothing frozen."""

import os

import torch

from unirl_core.algorithms.flow_grpo import FlowGRPO
from unirl_core.checkpoint import CheckpointStore, restore_train_checkpoint, save_train_checkpoint
from unirl_core.checkpoint.store import WEIGHTS
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.train import TrainBackend, TrainConfig


def _lora_backend():
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora"))
    return bundle, TrainBackend(bundle, FlowGRPO(), TrainConfig())


def test_trainable_scope_is_exactly_the_trainable_parameters():
    bundle, backend = _lora_backend()
    module = bundle.module
    trainable = {n: p for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
    buffers = {n for n, _ in module.named_buffers()}
    assert any(n.endswith("pos_embed") for n in buffers)  # the buffer the old scope carried along
    weights = backend.model_state_dict()
    assert set(weights) == set(trainable)
    assert not set(weights) & buffers and all("lora_" in n for n in weights)
    count = sum(p.numel() for p in trainable.values())
    assert sum(t.numel() for t in weights.values()) == count
    for n, t in weights.items():
        assert t.device.type == "cpu" and t.dtype == torch.float32 and t.shape == trainable[n].shape
        torch.testing.assert_close(t, trainable[n].detach().float().cpu(), rtol=0, atol=0)


def test_lora_version_size_is_the_adapter_and_restores(tmp_path):
    bundle, backend = _lora_backend()
    count = sum(p.numel() for p in bundle.module.parameters() if p.requires_grad)
    ref = save_train_checkpoint(CheckpointStore(str(tmp_path), "r"), backend)
    size = os.path.getsize(os.path.join(ref.uri, WEIGHTS))
    # fp32 tensors plus the safetensors JSON header (names, shapes, offsets)
    assert 4 * count <= size <= 4 * count + 16 * 1024, (size, 4 * count)

    bundle2, backend2 = _lora_backend()
    with torch.no_grad():
        for p in bundle2.module.parameters():
            if p.requires_grad:
                p.add_(1.0)
    restore_train_checkpoint(backend2, ref)
    for (n, a), (_, b) in zip(bundle.module.named_parameters(), bundle2.module.named_parameters()):
        assert torch.equal(a, b), n
