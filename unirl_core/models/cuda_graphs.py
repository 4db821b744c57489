"""CUDA graphs over a trainer's loss forward and its backward: the same kernels as eager, launched as two replays.

At the recipe shape a Flow-GRPO step of SD3.5-M at micro-batch 4 launches ~12,000 kernels per trained
timestep; many are short elementwise ops (modulation, norms, LoRA), so the host's launch rate, not the GPU,
sets the pace. :class:`TrainGraphs` captures the transformer's differentiable forward (and, through
``torch.cuda.make_graphed_callables``, its backward) once per input shape and replays both afterwards.

Exactness: a captured graph runs the kernels eager mode launched during capture, on the same shapes, so the
graphed forward gives the bits of the eager forward the rollout ran (checked on an H200 at the SD3.5-M
recipe shape: the graphed train forward equals an eager ``no_grad`` forward bitwise, and Flow-GRPO's first
update keeps ratio exactly 1; ``bench_flow_grpo_step.py``). The trainer's own first-update check still
guards every run.

What is graphed and what is not:

- only a forward with autograd on, through the trainable weights (LoRA enabled): the loss forward. The
  rollout, the no-grad pi_old replay and the KL reference forward (adapter off) stay eager - a replay of the
  train graph between a loss forward and its backward would overwrite the activations that backward needs;
- the trainable parameters (fp32 masters) are graph inputs, cast to the compute dtype inside the graph, so
  their gradients reach the masters as in eager mode and optimizer updates (in place) are seen by the next
  replay; frozen weights are read where they live, and a replay refuses to run if one was moved (it
  recaptures instead);
- one graph per distinct set of input shapes (at most ``max_shapes``; further shapes run eager). Each holds
  a private memory pool with one forward's activations for as long as the trainer lives;
- at most one forward per graph awaits its backward: a second forward of the same shape before the first
  one's backward (two CFG branches with gradient as separate forwards, Flux's or ``cfg_batch: split`` with
  ``cfg_grad: both``) runs eager, since a replay would overwrite the activations the pending backward reads.
  Forwards and log-probs stay exact then, but the two branches' gradients reach the masters as two fp32
  sums instead of one sum at the shared bf16 cast, so the update is not eager's bit for bit (it rounds less).

Not with FSDP sharding (hooks all-gather per forward) or activation checkpointing (recomputation reads the RNG
state, which a capture forbids); the owner checks that before building one.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

logger = logging.getLogger(__name__)


class TrainGraphs:
    """Graphed ``module(**tensors, **static)`` forwards with autograd, keyed by the tensors' shapes."""

    def __init__(self, module: nn.Module, named_masters: Sequence[tuple[str, nn.Parameter]], *,
                 compute_dtype: torch.dtype, max_shapes: int = 2,
                 make_graphed: Callable = torch.cuda.make_graphed_callables) -> None:
        self.module = module
        self.names = [n for n, _ in named_masters]
        self.masters = [p for _, p in named_masters]
        self.compute_dtype = compute_dtype
        self.max_shapes = max_shapes
        self._make_graphed = make_graphed  # a CPU test passes a stand-in to check the bookkeeping around it
        self._graphs: dict[tuple, object] = {}
        self._pending: dict[tuple, weakref.ref] = {}  # per graph: the output whose backward has not run yet
        self._frozen: list[tuple] = []
        self._warned: set[str] = set()
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0

    # -- the call -----------------------------------------------------------------------------
    def __call__(self, tensors: dict[str, Tensor], static: dict[str, object]) -> Tensor:
        """``module(**tensors, **static)[0]`` through the graph of these shapes (captured on first sight)."""
        if self._frozen and any(getattr(sub, store).get(name) is not t or t.data_ptr() != ptr
                                for sub, store, name, t, ptr in self._frozen):
            logger.info("cuda graphs: a frozen weight was replaced or moved since capture; recapturing")
            self.reset()
        keys = tuple(tensors)
        key = _key(keys, static, tensors)
        graphed = self._graphs.get(key)
        pending = self._pending.get(key)
        if pending is not None and pending() is not None:
            # A second forward of this graph before the first one's backward (e.g. two CFG branches with
            # gradient, as separate forwards): a replay would overwrite the activations that backward reads.
            return self._eager(static, tensors, "a forward before the previous one's backward")
        if graphed is None:
            if len(self._graphs) >= self.max_shapes:
                return self._eager(static, tensors, f"more than {self.max_shapes} input shapes")
            graphed = self._capture(keys, static, tensors, key)
        self.replays += 1
        out = graphed(*tensors.values(), *self.masters)
        if not out.requires_grad:
            return out.clone()
        # The graph's output lives in its static buffer, rewritten by the next replay: hand out a copy, through a
        # node that holds this forward's token until its backward starts or its autograd graph is freed.
        token = _Token(self._pending, key)
        self._pending[key] = weakref.ref(token)
        return _CopyUntilBackward.apply(out, token)

    def _eager(self, static: dict[str, object], tensors: dict[str, Tensor], why: str) -> Tensor:
        if why not in self._warned:
            logger.warning("cuda graphs: %s; such forwards run eager", why)
            self._warned.add(why)
        self.eager_calls += 1
        out = self.module(**tensors, **static)  # exactly the eager forward: the compute context's casts
        return out[0] if isinstance(out, (tuple, list)) else out

    def reset(self) -> None:
        """Drop every captured graph (their memory pools go with them)."""
        self._graphs.clear()
        self._pending.clear()
        self._frozen = []

    # -- capture ------------------------------------------------------------------------------
    def _forward(self, keys: tuple[str, ...], static: dict[str, object], *args: Tensor) -> Tensor:
        inputs, masters = args[:len(keys)], args[len(keys):]
        casts = {n: p.to(self.compute_dtype) for n, p in zip(self.names, masters)}
        out = functional_call(self.module, casts, (), {**dict(zip(keys, inputs)), **static})
        return out[0] if isinstance(out, (tuple, list)) else out

    def _capture(self, keys: tuple[str, ...], static: dict[str, object], tensors: dict[str, Tensor], key: tuple):
        # Sample inputs become the graph's static input buffers: own copies, not the caller's tensors. The
        # masters enter as fresh leaves over their storage (a replay then copies nothing for them and reads
        # what the optimizer wrote): the masters' own gradient accumulators may be alive on the default stream
        # (held by a compute context's casts), and a capture that reached one would join the legacy stream.
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors.values())
        aliases = tuple(p.detach().requires_grad_(p.requires_grad) for p in self.masters)

        def forward(*args: Tensor) -> Tensor:
            return self._forward(keys, static, *args)

        graphed = self._make_graphed(forward, (*sample, *aliases), num_warmup_iters=3, allow_unused_input=True)
        # Frozen weights where the graph read them (inside a compute context ``_parameters`` also holds casts of
        # the masters made outside the graph, which the graph does not read: only real Parameters and buffers).
        master_ids = {id(p) for p in self.masters}
        self._frozen = [(sub, store, name, t, t.data_ptr()) for sub in self.module.modules()
                        for store in ("_parameters", "_buffers") for name, t in getattr(sub, store).items()
                        if t is not None and id(t) not in master_ids
                        and (store == "_buffers" or isinstance(t, nn.Parameter))]
        self._graphs[key] = graphed
        self.captures += 1
        logger.info("cuda graphs: captured the train forward+backward for shapes %s",
                    {k: tuple(t.shape) for k, t in tensors.items()})
        return graphed


class _Token:
    """Marks one graph's forward as awaiting its backward, for as long as its autograd node holds it."""

    def __init__(self, pending: dict[tuple, weakref.ref], key: tuple) -> None:
        self.pending, self.key = pending, key

    def backward_started(self) -> None:
        ref = self.pending.get(self.key)
        if ref is not None and ref() is self:
            del self.pending[self.key]


class _CopyUntilBackward(torch.autograd.Function):
    """``x.clone()`` whose node keeps ``token`` (freed with the graph) and releases it when backward reaches it."""

    @staticmethod
    def forward(ctx, x: Tensor, token: _Token) -> Tensor:
        ctx.token = token
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        ctx.token.backward_started()
        return grad, None


def _key(keys: tuple[str, ...], static: dict[str, object], tensors: dict[str, Tensor]) -> tuple:
    return (keys, tuple(sorted(static.items())), *((t.shape, t.dtype, t.requires_grad) for t in tensors.values()))


def graph_pool_bytes(device: torch.device | str | None = None) -> int:
    """Bytes the caching allocator holds in private pools (CUDA graphs' memory), allocated or not."""
    if not torch.cuda.is_available():
        return 0
    segments = torch.cuda.memory_snapshot()
    dev = torch.device(device).index if device is not None else torch.cuda.current_device()
    return sum(s["total_size"] for s in segments
               if s.get("device", dev) == dev and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
