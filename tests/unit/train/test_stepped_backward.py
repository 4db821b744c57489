"""Flow-GRPO's loss is back-propagated one trained step at a time: the same gradient as one backward of the
whole loss, with only one step's graph alive at once (forward k+1 starts after backward k)."""

import torch

from tests.unit.algorithms.test_flow_grpo_cfg_grad import _rollout
from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.train import TrainBackend, TrainConfig


def _algo():
    return FlowGRPO(FlowGRPOConfig(replay_batch_size=4, clip_range=1.0, kl_beta=0.1))


def test_terms_add_up_to_the_loss_and_its_gradient():
    bundle, batch = _rollout()
    algo = _algo()
    bundle.module.zero_grad(set_to_none=True)
    whole = algo.loss(bundle, batch, old_log_probs=None)
    whole.loss.backward()
    want = {n: p.grad.clone() for n, p in bundle.module.named_parameters() if p.requires_grad}
    bundle.module.zero_grad(set_to_none=True)
    terms, n = algo.loss_terms(bundle, batch, old_log_probs=None), algo.num_loss_terms(batch)
    for _ in range(n):
        next(terms).backward()
    try:
        next(terms)
        raise AssertionError("more terms than num_loss_terms announced")
    except StopIteration as stop:
        out = stop.value
    assert n == 4  # 1 replay slice x 4 trained steps
    torch.testing.assert_close(float(whole.loss.detach()), out.metrics["loss"], rtol=1e-6, atol=1e-9)
    for name, p in bundle.module.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-8, msg=name)


def test_backend_frees_each_step_graph_before_the_next_forward():
    bundle, batch = _rollout()
    events = []

    def hook(_mod, _args, output):
        events.append("F")
        if output[0].requires_grad:
            output[0].register_hook(lambda g: events.append("B"))

    handle = bundle.module.register_forward_hook(hook)
    try:
        be = TrainBackend(bundle, FlowGRPO(FlowGRPOConfig(replay_batch_size=4, clip_range=1.0)),
                          TrainConfig(micro_batch_size=4, lr=1e-3))
        m = be.step(batch)
    finally:
        handle.remove()
    assert m.metrics["ratio_min"] == m.metrics["ratio_max"] == 1.0
    assert "".join(events) == "FB" * 4, "".join(events)
