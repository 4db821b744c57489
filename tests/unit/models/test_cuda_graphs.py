"""``diffusion.model.cuda_graphs``: the trainer's loss forward as a CUDA graph replay.

The capture itself needs a GPU (``bench_flow_grpo_step.py --cuda-graphs never,always`` runs it at the SD3.5-M recipe
shape and checks the first update's exact ratio there). Here, on the CPU: the config refuses what cannot work,
``auto`` falls back to eager, and the routing sends exactly the loss forwards through ``TrainGraphs`` - whose
call (the masters cast inside the call, through ``functional_call``) trains bitwise like eager mode. A
``TrainGraphs`` with room for no shape runs that same call without capturing, which is what these tests use.
"""

import copy
import logging

import pytest
import torch

from unirl_core.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl_core.errors import ConfigError
from unirl_core.models.cuda_graphs import TrainGraphs, graph_pool_bytes
from unirl_core.models.diffusion import DiffusionBundle, DiffusionModelConfig
from unirl_core.models.lora import lora_layers
from unirl_core.train import TrainBackend, TrainConfig
from unirl_core.train.optim import trainable_parameters

from tests.unit.algorithms.test_flow_grpo_cfg_grad import FBS
from tests.unit.algorithms.test_flow_grpo_cfg_grad import _rollout as rollout_with_advantages


@pytest.mark.parametrize("kwargs, value", [
    (dict(cuda_graphs="on"), "on"),
    (dict(cuda_graphs="always"), "always"),  # on a CPU device
    (dict(cuda_graphs="always", device="cuda", gradient_checkpointing=True), "always"),
])
def test_config_refuses_what_cannot_work(kwargs, value):
    with pytest.raises(ConfigError) as err:
        DiffusionModelConfig(source="tiny-sd3", **kwargs)
    msg = str(err.value)
    assert "model.cuda_graphs" in msg and value in msg, msg


def _backend(bundle: DiffusionBundle) -> TrainBackend:
    algo = FlowGRPO(FlowGRPOConfig(replay_batch_size=FBS, clip_range=1e-4, kl_beta=0.01))
    return TrainBackend(bundle, algo, TrainConfig(lr=1e-3, micro_batch_size=FBS, max_grad_norm=1.0))


def test_auto_on_a_cpu_trains_eager(caplog):
    torch.set_num_threads(1)
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype="bfloat16",
                                                        cuda_graphs="auto"))
    _, batch = rollout_with_advantages(bundle)
    with caplog.at_level(logging.INFO, logger="unirl_core.models.diffusion"):
        backend = _backend(bundle)
    assert bundle.train_graphs is None
    assert "model.cuda_graphs=auto: the trainer runs eager (model.device is cpu)" in caplog.text
    m = backend.step(batch).metrics
    assert m["ratio_min"] == m["ratio_max"] == 1.0
    assert graph_pool_bytes() == 0


def test_only_the_loss_forwards_go_through_the_graphs_and_train_bitwise_like_eager():
    """bf16 over fp32 LoRA masters: two steps through ``TrainGraphs``' call equal two eager steps bit for bit
    (first ratio exactly 1, same updated masters); pi_old and the KL reference forwards stay eager."""
    torch.set_num_threads(1)
    eager = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype="bfloat16"))
    graphed = copy.deepcopy(eager)
    _, batch = rollout_with_advantages(eager)
    backends = {}
    for name, bundle in (("eager", eager), ("graphed", graphed)):
        backends[name] = _backend(bundle)
    log: list[str] = []
    graphs = TrainGraphs(graphed.module, trainable_parameters(graphed.module), compute_dtype=torch.bfloat16,
                         make_graphed=_stand_in(log))
    graphed._train_graphs, graphed._lora_probe = graphs, lora_layers(graphed.module)[0]
    calls = []
    handle = graphed.module.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(torch.is_grad_enabled()), with_kwargs=True)
    try:
        results = {name: [be.step(batch) for _ in range(2)] for name, be in backends.items()}
    finally:
        handle.remove()
    first = results["graphed"][0].metrics
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["logp_absdiff_max"] == 0.0
    for a, b in zip(results["eager"], results["graphed"]):
        assert a.loss == b.loss and a.grad_norm == b.grad_norm and a.metrics == b.metrics, (a, b)
    for (n, p), (_, q) in zip(trainable_parameters(eager.module), trainable_parameters(graphed.module)):
        assert p.dtype == torch.float32 and torch.equal(p, q), n
    trained_steps = int(first["trained_steps"])
    # per step: one routed loss forward per trained step and slice; the KL reference (no grad) is not routed
    assert graphs.replays == log.count("replay") == 2 * trained_steps * (len(batch) // FBS)
    assert graphs.eager_calls == 0 and log.count("capture") == 1 and calls.count(True) == graphs.replays
    assert calls.count(False) > 0  # pi_old replay / KL reference: eager, without autograd


def test_the_graph_call_reads_the_masters_not_the_outer_casts():
    """Inside a compute context the module holds casts of the masters made outside the call; the graph's call
    casts the masters itself, so an optimizer's in-place update is what the next call sees."""
    torch.set_num_threads(1)
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype="bfloat16"))
    named = trainable_parameters(bundle.module)
    for _, p in named:
        p.data = p.data.float()
    graphs = TrainGraphs(bundle.module, named, compute_dtype=torch.bfloat16, make_graphed=_stand_in([]))
    cfg = bundle.module.config
    g = torch.Generator().manual_seed(0)
    tensors = dict(hidden_states=torch.randn(2, cfg.in_channels, 8, 8, generator=g).bfloat16(),
                   encoder_hidden_states=torch.randn(2, 5, cfg.joint_attention_dim, generator=g).bfloat16(),
                   pooled_projections=torch.randn(2, cfg.pooled_projection_dim, generator=g).bfloat16(),
                   timestep=torch.full((2,), 500.0))
    with bundle.compute():
        before = graphs(tensors, {"return_dict": False}).detach()  # dropped graph: the next call replays
        with torch.no_grad():
            for n, p in named:
                if "lora_B" in n:
                    p.add_(0.05)
        after = graphs(tensors, {"return_dict": False})
    with bundle.compute():
        eager = bundle.module(**tensors, return_dict=False)[0]
    assert graphs.replays == 2 and not torch.equal(before, after) and torch.equal(after, eager)
    after.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for _, p in named)


def _stand_in(log: list[str]):
    """Stands in for ``torch.cuda.make_graphed_callables`` on the CPU: the "graph" runs the captured function
    eagerly. What is under test is ``TrainGraphs``' bookkeeping around it (which forwards replay, which run
    eager), not CUDA's capture."""
    def make_graphed(fn, sample_args, **_):
        log.append("capture")

        def graphed(*args):
            log.append("replay")
            return fn(*args)
        return graphed
    return make_graphed


@pytest.mark.parametrize("cfg_batch, cfg_grad, per_step", [
    ("joint", "cond", ["replay"]),            # one forward of [uncond; cond] with gradient per trained step
    ("split", "both", ["replay", "eager"]),   # two forwards with gradient before the backward: the second eager
])
def test_a_second_forward_before_the_backward_runs_eager(cfg_batch, cfg_grad, per_step):
    torch.set_num_threads(1)
    eager = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype="bfloat16",
                                                       cfg_batch=cfg_batch))
    graphed = copy.deepcopy(eager)
    _, batch = rollout_with_advantages(eager)
    algo = dict(replay_batch_size=FBS, clip_range=1e-4, kl_beta=0.01, cfg_grad=cfg_grad)
    backends = {name: TrainBackend(b, FlowGRPO(FlowGRPOConfig(**algo)), TrainConfig(lr=1e-3, micro_batch_size=FBS))
                for name, b in (("eager", eager), ("graphed", graphed))}
    log: list[str] = []
    graphs = TrainGraphs(graphed.module, trainable_parameters(graphed.module), compute_dtype=torch.bfloat16,
                         make_graphed=_stand_in(log))
    graphed._train_graphs, graphed._lora_probe = graphs, lora_layers(graphed.module)[0]
    results = {name: [be.step(batch) for _ in range(2)] for name, be in backends.items()}
    first = results["graphed"][0].metrics
    steps = int(first["trained_steps"]) * (len(batch) // FBS)
    assert first["ratio_min"] == first["ratio_max"] == 1.0 and first["logp_absdiff_max"] == 0.0
    assert log[0] == "capture" and log.count("capture") == 1
    assert graphs.replays == log.count("replay") == 2 * steps
    assert graphs.eager_calls == 2 * steps * per_step.count("eager")
    assert results["eager"][0].metrics == first  # the first step's forwards are eager's exactly
    pairs = list(zip(trainable_parameters(eager.module), trainable_parameters(graphed.module)))
    if "eager" not in per_step:
        assert all(torch.equal(p, q) for (_, p), (_, q) in pairs)
    else:  # the branches' gradients summed in fp32 at the masters, not in bf16 at one shared cast: the first
        # step's gradient norm agrees to bf16's unit roundoff (2^-8), its loss and forwards exactly
        (ge,), (gg,) = results["eager"][0].grad_norms, results["graphed"][0].grad_norms
        assert abs(ge - gg) / ge < 2**-8, (ge, gg)


def test_a_forward_dropped_without_backward_does_not_block_the_graph():
    torch.set_num_threads(1)
    bundle = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3", finetune="lora", dtype="bfloat16"))
    named = trainable_parameters(bundle.module)
    for _, p in named:
        p.data = p.data.float()
    log: list[str] = []
    graphs = TrainGraphs(bundle.module, named, compute_dtype=torch.bfloat16, make_graphed=_stand_in(log))
    cfg = bundle.module.config
    tensors = dict(hidden_states=torch.randn(2, cfg.in_channels, 8, 8).bfloat16(),
                   encoder_hidden_states=torch.randn(2, 5, cfg.joint_attention_dim).bfloat16(),
                   pooled_projections=torch.randn(2, cfg.pooled_projection_dim).bfloat16(),
                   timestep=torch.full((2,), 500.0))
    with bundle.compute():
        kept = graphs(tensors, {"return_dict": False})
        graphs(tensors, {"return_dict": False})       # pending backward of `kept`: eager
        assert (graphs.replays, graphs.eager_calls) == (1, 1)
        del kept                                      # nobody can run its backward any more
        out = graphs(tensors, {"return_dict": False})
        assert (graphs.replays, graphs.eager_calls) == (2, 1)
        out.float().sum().backward()                  # backward started: the graph is free again
        graphs(tensors, {"return_dict": False})
        assert (graphs.replays, graphs.eager_calls) == (3, 1)
