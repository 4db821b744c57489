"""A named pool's host shares its tenants' frozen base tensors (``pool/frozen.py``): built here as the host builds
them (``TenantHost.attach``, in this process, no Ray cluster): one tensor object per frozen name, each tenant's own
adapter, and training one tenant leaves the other's outputs bitwise as they were."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.flyte.conftest import SMALL
from unirl_core.config import load_recipe
from unirl_core.errors import ConfigError, InvariantError
from unirl_core.pool.actors import EngineActor, TrainerActor
from unirl_core.pool.frozen import FrozenShare, frozen_slots, held_bytes, same_bits
from unirl_core.pool.tenants import TenantHost

LORA = {"tiny-grpo": "lm.model.finetune=lora", "tiny-flow-grpo": "diffusion.model.finetune=lora"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _cfg(recipe: str, name: str, seed: int, *extra: str):
    return load_recipe(recipe, [*SMALL[recipe], LORA[recipe], f"name={name}", f"loop.seed={seed}",
                                "pool.execution=pool", "pool.name=p", "pool.publish=object_store", *extra])


def _host(role: str, cls: type, recipe: str, n: int = 2) -> TenantHost:
    host = TenantHost("p", role, idle_timeout_s=3600.0)
    for i in range(n):
        assert host.attach(f"run-{i}", cls, _cfg(recipe, f"run-{i}", i), 1)
    return host


def _tensors(obj) -> dict[tuple, torch.Tensor]:
    return {key: t for key, _, _, t in frozen_slots(obj.frozen_modules())}


def _adapters(obj) -> dict[str, torch.Tensor]:
    return {f"{m}.{n}": p for m, mod in obj.frozen_modules().items() for n, p in mod.named_parameters()
            if "lora_" in n}


def _output(obj, recipe: str) -> torch.Tensor:
    """A forward of the tenant's trained module on fixed inputs, in its compute context."""
    policy = obj.backend.policy
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad(), policy.compute():
        if recipe == "tiny-grpo":
            ids = torch.randint(0, 200, (2, 12), generator=gen)
            return policy.module(input_ids=ids).logits.float().clone()
        cfg = policy.module.config
        x = torch.randn(2, cfg.in_channels, 8, 8, generator=gen).to(policy.dtype)
        text = torch.randn(2, 4, cfg.joint_attention_dim, generator=gen).to(policy.dtype)
        pooled = torch.randn(2, cfg.pooled_projection_dim, generator=gen).to(policy.dtype)
        return policy.module(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled,
                             timestep=torch.tensor([500.0, 250.0])).sample.float().clone()


def _train_step(obj, recipe: str) -> None:
    """One optimizer step of the tenant's own backend (its adapter; the base is frozen)."""
    backend = obj.backend
    backend.optimizer.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(1)
    policy = backend.policy
    with policy.compute():
        if recipe == "tiny-grpo":
            out = policy.module(input_ids=torch.randint(0, 200, (2, 12), generator=gen)).logits
        else:
            cfg = policy.module.config
            out = policy.module(hidden_states=torch.randn(2, cfg.in_channels, 8, 8, generator=gen).to(policy.dtype),
                                encoder_hidden_states=torch.randn(2, 4, cfg.joint_attention_dim,
                                                                  generator=gen).to(policy.dtype),
                                pooled_projections=torch.randn(2, cfg.pooled_projection_dim,
                                                               generator=gen).to(policy.dtype),
                                timestep=torch.tensor([500.0, 250.0])).sample
    out.float().pow(2).mean().backward()
    backend.optimizer.step()


@pytest.mark.parametrize("recipe", sorted(LORA))
def test_trainer_tenants_share_the_frozen_base_not_the_adapter_and_train_apart(recipe):
    host = _host("trainer-0", TrainerActor, recipe)
    a, b = host.tenants["run-0"], host.tenants["run-1"]
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 10
    # one storage per frozen name, each tenant its own alias of it (a tenant's cast or requires_grad stays its own)
    assert all(ta[k].data_ptr() == tb[k].data_ptr() and ta[k] is not tb[k] for k in ta)
    assert {t.data_ptr() for t in ta.values()} == {t.data_ptr() for t in tb.values()}
    aa, ab = _adapters(a), _adapters(b)
    assert aa.keys() == ab.keys() and aa
    assert all(aa[k].data_ptr() != ab[k].data_ptr() for k in aa)
    # every tensor the optimizer steps is the tenant's own and no shared one
    shared = {t.data_ptr() for t in ta.values()}
    assert not any(p.data_ptr() in shared for p in a.backend.params) and a.backend.params

    before_b, before_a = _output(b, recipe), _output(a, recipe)
    base_before = {k: t.clone() for k, t in tb.items()}
    host.tenants["run-0"].step_a = lambda: _train_step(a, recipe)
    host.call("run-0", "step_a")  # as the host runs a tenant's call: checks no shared tensor was written
    # a restore, as the trainer does from a version (weights, optimizer state): the adapter only is written
    a.restore = lambda: (a.backend.load_model_state_dict(a.backend.model_state_dict()),
                         a.backend.load_state_dict(a.backend.state_dict()))
    host.call("run-0", "restore")
    assert not torch.equal(_output(a, recipe), before_a)  # A trained (its adapter moved)
    assert torch.equal(_output(b, recipe), before_b)  # B: bitwise as before
    assert all(same_bits(tb[k], base_before[k]) for k in tb)


def _scribbler(fail: bool):
    """A trainer host whose tenant run-0 has a method ``scribble`` writing into its first shared tensor (then
    raising, with ``fail``); returns the host, the tenant and the tensor's key."""
    host = _host("trainer-0", TrainerActor, "tiny-grpo")
    a = host.tenants["run-0"]
    key, t = next(iter(_tensors(a).items()))

    def scribble():
        with torch.no_grad():
            t.add_(1)
        if fail:
            raise RuntimeError("the call's own error")
    a.scribble = scribble
    return host, a, key


def test_a_write_into_a_shared_tensor_fails_the_call_naming_it():
    host, a, key = _scribbler(fail=False)
    with pytest.raises(InvariantError, match=rf"scribble of run 'run-0'.*{key[1]}"):
        host.call("run-0", "scribble")
    # the base stays written: a later, innocent call fails too, naming the call that wrote it, not itself
    a.innocent = lambda: None
    with pytest.raises(InvariantError, match=rf"scribble of run 'run-0'.*{key[1]}") as later:
        host.call("run-0", "innocent")
    assert "innocent" not in str(later.value)


def test_a_written_tensor_fails_only_the_tenants_holding_it_and_is_forgotten_with_them():
    a, b, share = _pair()
    other = torch.nn.Linear(2, 2).requires_grad_(False)  # another base: shares nothing with a and b
    share.share({"module": other})
    holds_ab = lambda t: t.untyped_storage().data_ptr() == a.bias.untyped_storage().data_ptr()  # noqa: E731
    with torch.no_grad():
        b.bias.add_(1.0)
    with pytest.raises(InvariantError, match=r"b writes.*module.bias"):
        share.check("b writes", holds_ab)
    share.check("the other base's call", lambda t: False)  # a tenant not holding it runs on
    with pytest.raises(InvariantError, match=r"b writes.*module.bias"):
        share.check("a's next call", holds_ab)
    del a, b  # both tenants dropped: the written tensor is gone, and with it the failure
    share.check("a new tenant's call")


def test_a_call_that_writes_then_fails_is_named_as_the_writer():
    host, _, key = _scribbler(fail=True)
    with pytest.raises(InvariantError, match=rf"scribble of run 'run-0'.*{key[1]}") as e:
        host.call("run-0", "scribble")
    assert isinstance(e.value.__context__, RuntimeError)  # the call's own error, chained


def test_engine_tenants_share_the_pipeline_components_and_halve_the_bytes_held():
    host = _host("engine-0", EngineActor, "tiny-flow-grpo", n=1)
    one = host.memory()
    host.attach("run-1", EngineActor, _cfg("tiny-flow-grpo", "run-1", 1), 1)
    two = host.memory()
    a, b = host.tenants["run-0"], host.tenants["run-1"]
    assert {"module", "vae", "text_encoder"} <= a.frozen_modules().keys()
    ta, tb = _tensors(a), _tensors(b)
    assert {k[0] for k in ta} >= {"module", "vae", "text_encoder"} and all(ta[k].data_ptr() == tb[k].data_ptr() for k in ta)
    adapter = sum(p.numel() * p.element_size() for p in _adapters(b).values())
    assert two["tenants"] == 2 and two["shared_tensors"] > 0
    assert two["param_bytes"] == one["param_bytes"] + adapter  # the second tenant adds its adapter only
    assert two["param_bytes"] == held_bytes([m for obj in (a, b) for m in obj.frozen_modules().values()])
    assert two["param_bytes_unshared"] == 2 * one["param_bytes"]  # without sharing: two full copies


def test_a_tensor_that_differs_stays_the_tenants_own():
    share = FrozenShare()
    m1, m2 = torch.nn.Linear(3, 3).requires_grad_(False), torch.nn.Linear(3, 3).requires_grad_(False)
    with torch.no_grad():
        m2.weight.copy_(m1.weight)
        m2.bias.copy_(m1.bias)
        m2.bias[0] = torch.nextafter(m1.bias[0], torch.tensor(1e9))  # one bit off
    share.share({"m": m1})
    stats = share.share({"m": m2})
    assert (stats.frozen, stats.shared) == (2, 1)
    assert m2.weight.data_ptr() == m1.weight.data_ptr() and m2.weight is not m1.weight
    assert m2.bias.data_ptr() != m1.bias.data_ptr()


def test_a_named_pool_refuses_a_full_state_weights_scope():
    with pytest.raises(ConfigError, match=r"train.weights_scope.*'full'.*trainable"):
        _cfg("tiny-grpo", "r", 0, "train.weights_scope=full")


def _pair():
    a = torch.nn.Linear(4, 4).requires_grad_(False)
    b = torch.nn.Linear(4, 4).requires_grad_(False)
    b.load_state_dict(a.state_dict())
    share = FrozenShare()
    share.share({"module": a})
    assert share.share({"module": b}).shared == 2
    return a, b, share


def test_a_tenants_cast_or_requires_grad_toggle_stays_its_own():
    """Tenants share storage, not tensor objects: ``b.half()`` (nn.Module._apply swaps ``param.data``) and a
    ``requires_grad_`` on b leave a's tensors as they were; an in-place write through b is still caught."""
    a, b, share = _pair()
    b.weight.requires_grad_(True)
    assert not a.weight.requires_grad
    b.half()
    share.check("b.half")
    assert a.weight.dtype == torch.float32 and b.weight.dtype == torch.float16
    a2, b2, share2 = _pair()
    with torch.no_grad():
        b2.bias.add_(1.0)
    with pytest.raises(InvariantError, match="module.bias"):
        share2.check("b2.bias.add_")


def test_a_shared_tensor_stays_shared_and_guarded_after_the_tenant_that_brought_it_left():
    """Three tenants of one base: once the first is dropped, the other two still share its tensors (a memory read
    counts them), a fourth is rebound to them, and a write through one of them is still caught."""
    first = torch.nn.Linear(3, 3).requires_grad_(False)
    later = [torch.nn.Linear(3, 3).requires_grad_(False) for _ in range(3)]
    for module in later:
        module.load_state_dict(first.state_dict())
    del module
    share = FrozenShare()
    share.share({"module": first})
    share.share({"module": later[0]})
    share.share({"module": later[1]})
    assert share.shared_count() == 2
    gone = weakref.ref(first.weight)
    del first
    gc.collect()
    assert gone() is None  # the tenant that brought the tensors left, and its tensor objects with it
    share.check("first left")
    assert share.shared_count() == 2  # still held by two tenants
    stats = share.share({"module": later[2]})
    assert (stats.frozen, stats.shared) == (2, 2)
    assert later[2].weight.data_ptr() == later[0].weight.data_ptr() == later[1].weight.data_ptr()
    with torch.no_grad():
        later[1].bias.add_(1.0)
    with pytest.raises(InvariantError, match=r"later\[1\] writes.*module.bias"):
        share.check("later[1] writes")
    del later
    gc.collect()
    share.check("every tenant left")  # nothing held, nothing to name
    assert share.shared_count() == 0


def test_a_tenant_that_cast_its_copy_no_longer_stands_for_the_shared_tensor():
    """b casts (its own copy now) and the tenant that brought the tensors leaves: a new tenant is rebound to the
    storage c still shares, not to b's cast copy, and a write through c is named to a tenant holding it."""
    a, b, share = _pair()
    c = torch.nn.Linear(4, 4).requires_grad_(False)
    c.load_state_dict(a.state_dict())
    assert share.share({"module": c}).shared == 2
    b.half()
    del a
    gc.collect()
    share.check("a left")
    assert share.shared_count() == 2  # c's (b holds its own cast copy now)
    d = torch.nn.Linear(4, 4).requires_grad_(False)
    d.load_state_dict(c.state_dict())
    assert share.share({"module": d}).shared == 2
    assert d.weight.data_ptr() == c.weight.data_ptr() != b.weight.data_ptr()
    with torch.no_grad():
        c.bias.add_(1.0)
    holds_d = lambda t: t.untyped_storage().data_ptr() == d.bias.untyped_storage().data_ptr()  # noqa: E731
    with pytest.raises(InvariantError, match=r"c writes.*module.bias"):
        share.check("c writes", lambda t: False)  # the writing call itself always fails
    with pytest.raises(InvariantError, match=r"c writes.*module.bias"):
        share.check("d's next call", holds_d)
