"""TrainBackend: one optimizer loop for every model family, driven by an Algorithm's loss.

Per rollout batch (``step``): take this rank's contiguous shard, cut it into micro-batches (consecutive
slices, or token-budget packs with ``micro_batch_tokens``: ``unirl_core.models.micro_batch``), freeze
pi_old once (rollout log-probs, or a no-grad replay over exactly these micro-batches before any update),
then run ``num_updates_per_batch`` passes of gradient accumulation -> clip ->
AdamW -> schedule (-> EMA). The same code runs at world size 1 (plain module) and above (FSDP2).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from unirl_core.algorithms.base import Algorithm, LossOutput, Policy
from unirl_core.algorithms.off_policy import TRAINER_VERSION_KEY
from unirl_core.errors import CheckpointError, ConfigError, NumericsError, field_error
from unirl_core.models.micro_batch import plan_micro_batches, split_to_count, token_lengths
from unirl_core.models.precision import module_dtype, parameters_as, rounded, upcast_trainable
from unirl_core.train import distributed as D
from unirl_core.train.config import TrainConfig
from unirl_core.train.ema import ParameterEMA
from unirl_core.checkpoint.host_staging import HostStaging
from unirl_core.train.optim import build_optimizer, build_scheduler, trainable_parameters
from unirl_core.train.stateful import CheckpointableState
from unirl_core.checkpoint.rng import capture_rng, restore_rng, seed_everything
from unirl_core.types import SampleBatch

log = logging.getLogger(__name__)

@dataclass(kw_only=True)
class TrainMetrics:
    """What one rollout batch did to the weights."""

    step: int
    """Rollout batches trained so far (the policy version the new weights carry)."""
    optimizer_steps: int
    """Optimizer updates so far."""
    loss: float
    """The batch loss (micro-batch losses weighted by their share of the algorithm's units - samples, or loss
    tokens for a token-mean loss - as backward weights them),
    averaged over updates and ranks."""
    grad_norms: tuple[float, ...]
    """Global pre-clip gradient L2 norm of each update."""
    lr: float
    """Learning rate the last update used."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Algorithm metrics averaged over micro-batches of all updates and over ranks."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent in ``old_logp``, ``forward_backward``, ``optimizer`` and ``total``."""
    num_samples: int = 0
    """Samples of the whole rollout batch (all ranks)."""

    @property
    def grad_norm(self) -> float:
        return self.grad_norms[-1]

    def as_dict(self) -> dict[str, float]:
        """Flat float view for loggers and decks."""
        out = {"step": float(self.step), "optimizer_steps": float(self.optimizer_steps), "loss": self.loss,
               "grad_norm": self.grad_norm, "lr": self.lr, "num_samples": float(self.num_samples)}
        out.update(self.metrics)
        out.update({f"time_{k}": v for k, v in self.timings.items()})
        return out


def _accumulate_metric(sums: dict[str, float], counts: dict[str, int], key: str, value: float) -> None:
    """Running reduction of one micro-batch metric: extremes for ``*_max`` / ``*_min``, sums otherwise."""
    if key.endswith("_max"):
        sums[key], counts[key] = max(sums.get(key, -math.inf), value), 1
    elif key.endswith("_min"):
        sums[key], counts[key] = min(sums.get(key, math.inf), value), 1
    else:
        sums[key] = sums.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1


def _module_device(module: torch.nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def names_in_order(module: torch.nn.Module) -> list[str]:
    """State-dict keys in module order (tied weights appear under each of their names)."""
    return list(module.state_dict().keys())


class TrainBackend(CheckpointableState):
    """Owns optimizer, scheduler, precision, EMA, sharding and RNG of one policy.

    The backend owns ``policy``: its module is prepared in place (trainable parameters become fp32 master
    weights; at world size > 1 with ``cfg.shard='auto'``, or always with ``'always'``, it is sharded with
    FSDP2), so a rollout must not sample with the same bundle object afterwards unless it enters the
    bundle's ``compute()`` (the trainside engines do) and the module is not sharded. The loop gives the
    trainer a bundle of its own. Every forward runs in the policy's compute context
    (``unirl_core.models.precision``): the parameters as the model dtype, natively, exactly what the
    rollout ran. Call :func:`init_distributed` first (or pass ``dist_info``) when launched by torchrun.
    """

    def __init__(self, policy: Policy, algorithm: Algorithm, cfg: TrainConfig, *,
                 dist_info: D.DistInfo | None = None) -> None:
        for obj, proto, name in ((policy, Policy, "policy"), (algorithm, Algorithm, "algorithm")):
            if not isinstance(obj, proto):
                raise field_error(ConfigError, name, type(obj).__name__, f"an object implementing {proto.__name__}",
                                  "see unirl_core.algorithms.base for the contract")
        self.policy, self.algorithm, self.cfg = policy, algorithm, cfg
        # Without dist_info the device is the module's: a CPU model stays on gloo on a host that also has CUDA.
        self.dist = dist_info or D.init_distributed(device=_module_device(policy.module))
        if cfg.shard == "always":
            D.ensure_process_group(self.dist.device)
        self.rank, self.world_size = D.current_world()
        if cfg.micro_batch_tokens is not None and self.world_size > 1 and cfg.old_logp_source != "replay":
            # Each rank packs its own shard (the engine packed the whole batch), so pi_old must be replayed.
            raise field_error(ConfigError, "train.old_logp_source", cfg.old_logp_source,
                              f"'replay' with train.micro_batch_tokens at world size {self.world_size}",
                              "set train.old_logp_source='replay' (or micro_batch_size for exact rollout log-probs)")
        seed_everything(cfg.seed + self.rank)
        module = policy.module
        self.compute_dtype: torch.dtype = getattr(policy, "compute_dtype", None) or module_dtype(module)
        if D.is_sharded(module):
            raise field_error(ConfigError, "policy.module", "already sharded", "a module no backend has prepared",
                              "build one TrainBackend per bundle (the backend owns its module)")
        if cfg.master_weights == "fp32":
            upcast = upcast_trainable(module)
            if upcast:
                log.info("upcast %d trainable tensors to fp32 master weights", upcast)
        named = trainable_parameters(module)
        if cfg.shard == "always" or (cfg.shard == "auto" and self.world_size > 1):
            mp = None if self.compute_dtype == torch.float32 else self.compute_dtype
            D.apply_fsdp(module, cfg.fsdp_wrap_classes, mp, device=self.dist.device)
            named = trainable_parameters(module)  # fully_shard swapped the parameters for DTensor shards
        self.sharded = D.is_sharded(module)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        attach = getattr(policy, "attach_trainer", None)
        if callable(attach):  # e.g. a diffusion bundle building its CUDA graphs over these masters
            attach(named, sharded=self.sharded)
        self.optimizer = build_optimizer(self.params, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.compute_dtype == torch.float16)
        self.ema = ParameterEMA(named, cfg.ema_decay) if cfg.ema_decay is not None else None
        self.step_count = 0
        self.optimizer_steps = 0
        log.info("train backend: %d trainable tensors (%.3fM params), world=%d, sharded=%s, precision=%s",
                 len(self.params), sum(p.numel() for p in self.params) / 1e6,  # DTensor numel is global
                 self.world_size, self.sharded, self.compute_dtype)

    @property
    def policy_version(self) -> int:
        """Version the current weights carry: the number of rollout batches trained on."""
        return self.step_count

    def compute(self) -> AbstractContextManager[None]:
        """The policy's compute context around every forward (pi_old replay and loss)."""
        if hasattr(self.policy, "compute"):
            return self.policy.compute()
        if self.sharded or self.compute_dtype == torch.float32:
            return nullcontext()
        return parameters_as(self.policy.module, self.compute_dtype)

    def ema_applied(self) -> AbstractContextManager[None]:
        """Within this context the module carries the EMA weights (for EMA rollout or eval)."""
        if self.ema is None:
            raise field_error(ConfigError, "train.ema_decay", None, "a decay to keep an EMA",
                              "set ema_decay in TrainConfig to sample with EMA weights")
        return self.ema.applied()

    # ----------------------------------------------------------------------------------- one rollout batch

    def local_shard(self, batch: SampleBatch) -> SampleBatch:
        """This rank's contiguous equal share of the rollout batch."""
        n = len(batch)
        if n == 0 or n % self.world_size:
            raise field_error(ConfigError, "batch size", n, f"a positive multiple of world_size={self.world_size}",
                              "FSDP ranks must run the same number of forward passes; resize the rollout batch")
        per = n // self.world_size
        return batch[self.rank * per:(self.rank + 1) * per]

    def micro_batches(self, shard: SampleBatch) -> list[SampleBatch]:
        """This rank's micro-batches in the order they run: the engine's rescoring plan
        (``unirl_core.models.micro_batch``), consecutive ``micro_batch_size`` slices or token-budget packs."""
        if self.cfg.micro_batch_tokens is None:
            return shard.split(self.cfg.micro_batch_size)
        lengths = token_lengths([p.segment for p in shard.generated])
        plan = plan_micro_batches(lengths, size=self.cfg.micro_batch_size, max_tokens=self.cfg.micro_batch_tokens)
        if self.world_size > 1:  # FSDP ranks must run the same number of forwards
            count = torch.tensor([len(plan)], device=self.dist.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            plan = split_to_count(plan, int(count))
        return [shard.select(idx) for idx in plan]

    def step(self, batch: SampleBatch) -> TrainMetrics:
        """Train on one rollout batch; returns metrics averaged over micro-batches and ranks (``*_max`` /
        ``*_min`` metrics: the extreme over micro-batches and ranks)."""
        t_start = time.perf_counter()
        # which version trains it: algorithms hold only fresh rows to the rollout-vs-replay tolerance
        batch = SampleBatch(samples=batch.samples, metadata={**batch.metadata, TRAINER_VERSION_KEY: str(self.step_count)})
        micro = self.micro_batches(self.local_shard(batch))
        t0 = time.perf_counter()
        old = self._freeze_old_log_probs(micro)
        t_old = time.perf_counter() - t0
        local_n = sum(len(mb) for mb in micro)
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        grad_norms: list[float] = []
        loss_sums: list[Tensor] = []
        t_fb = t_opt = 0.0
        lr = self.scheduler.get_last_lr()[0]
        # The rollout-vs-replay gap is only defined while the weights are the ones that sampled the batch.
        on_policy = all(p.policy_version == self.step_count for p in batch.generated)
        for update in range(self.cfg.num_updates_per_batch):
            t0 = time.perf_counter()
            loss_sums.append(self._accumulate(micro, old, local_n, sums, counts,
                                              first_update=update == 0 and on_policy))
            t1 = time.perf_counter()
            lr = self.scheduler.get_last_lr()[0]
            grad_norms.append(self._optimizer_step())
            t_fb += t1 - t0
            t_opt += time.perf_counter() - t1
        self.step_count += 1
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize(self.dist.device)
        sums["loss"] = float(torch.stack(loss_sums).sum())
        counts["loss"] = self.cfg.num_updates_per_batch
        means = {k: sums[k] / counts[k] for k in sums}
        means = D.all_reduce_metrics(means, self.dist.device)
        loss = means.pop("loss")
        timings = {"old_logp": t_old, "forward_backward": t_fb, "optimizer": t_opt,
                   "total": time.perf_counter() - t_start}
        return TrainMetrics(step=self.step_count, optimizer_steps=self.optimizer_steps, loss=loss,
                            grad_norms=tuple(grad_norms), lr=lr, metrics=means, timings=timings,
                            num_samples=len(batch))

    @torch.no_grad()
    def _freeze_old_log_probs(self, micro: list[SampleBatch]) -> list[Tensor | None]:
        if self.cfg.old_logp_source == "rollout":
            return [None] * len(micro)
        out = []
        # An algorithm whose pi_old is a smoothed sampling policy (DiffusionNFT's v_old) evaluates it under EMA.
        old_weights = self.ema_applied() if getattr(self.algorithm, "old_policy", "policy") == "ema" else nullcontext()
        with old_weights, self.compute():
            for mb in micro:
                out.append(self.algorithm.old_log_probs(self.policy, mb).detach())
        return out

    def _accumulate(self, micro: list[SampleBatch], old: list[Tensor | None], local_n: int,
                    sums: dict[str, float], counts: dict[str, int], *, first_update: bool) -> Tensor:
        """Backward every micro-batch; returns the batch loss: the micro-batch losses weighted by their share.

        ``first_update``: the weights are still the rollout's, so the algorithm holds the rollout-vs-replay
        log-prob gap to its tolerance (whatever ``old_logp_source`` is).
        """
        loss_sum: Tensor | None = None
        # Each micro-batch loss is a mean over the algorithm's units (samples; loss tokens for a token-mean loss
        # such as dapo): weight it by its share of them, so packing and a ragged tail do not change the batch loss.
        units_of = getattr(self.algorithm, "micro_batch_units", None)
        units = [float(units_of(mb)) if units_of is not None else float(len(mb)) for mb in micro]
        total = sum(units)
        if total <= 0:  # nothing enters the loss anywhere (e.g. every completion masked): fall back to samples
            units, total = [float(len(mb)) for mb in micro], float(local_n)
        for i, (mb, olp) in enumerate(zip(micro, old)):
            weight = units[i] / total
            # Backward inside the compute context too: activation checkpointing recomputes forwards during
            # backward, and they must see the same parameter casts as the first pass.
            with self.compute():
                out = self._backward(mb, olp, weight, last_micro_batch=i == len(micro) - 1,
                                     first_update=first_update)
            # The loss stays a tensor until the end of the step: a float() here would stall a GPU per micro-batch.
            part = out.loss.detach().float() * weight
            loss_sum = part if loss_sum is None else loss_sum + part
            for k, v in out.metrics.items():
                _accumulate_metric(sums, counts, k, float(v))
        return loss_sum

    def _backward(self, mb: SampleBatch, olp: Tensor | None, weight: float, *, last_micro_batch: bool,
                  first_update: bool) -> LossOutput:
        """Back-propagate one micro-batch: term by term when the algorithm yields its loss in pieces
        (``loss_terms``: Flow-GRPO's trained steps, so one step's graph is alive at a time), else in one go.

        Under FSDP2 gradients are reduce-scattered once per rollout batch: only the very last backward of
        the last micro-batch syncs (``num_loss_terms`` says which one that is, without running ahead).
        """
        module = self.policy.module
        kw = dict(old_log_probs=olp, first_update=first_update)
        if not hasattr(self.algorithm, "loss_terms"):
            if self.sharded:
                module.set_requires_gradient_sync(last_micro_batch)
            out = self.algorithm.loss(self.policy, mb, **kw)
            self.scaler.scale(out.loss.float() * weight).backward()
            return out
        n = self.algorithm.num_loss_terms(mb)
        terms = self.algorithm.loss_terms(self.policy, mb, **kw)
        for j in range(n):
            term = next(terms)
            if self.sharded:
                module.set_requires_gradient_sync(last_micro_batch and j == n - 1)
            self.scaler.scale(term.float() * weight).backward()
            del term  # this step's graph is freed before the next step's forward
        try:
            next(terms)
        except StopIteration as stop:
            return stop.value
        raise field_error(ConfigError, "algorithm.num_loss_terms", n, "the number of terms loss_terms yields",
                          f"{type(self.algorithm).__name__} yielded more terms than it announced")

    def _optimizer_step(self) -> float:
        self.scaler.unscale_(self.optimizer)
        grads = [p for p in self.params if p.grad is not None]
        if self.cfg.max_grad_norm is None:
            total = torch.nn.utils.get_total_norm([p.grad for p in grads], foreach=True)
        else:
            total = torch.nn.utils.clip_grad_norm_(grads, self.cfg.max_grad_norm, foreach=True)
        norm = float(D.full_tensor(total))
        if not math.isfinite(norm) and not self.scaler.is_enabled():
            raise field_error(NumericsError, "grad_norm", norm, "a finite gradient norm",
                              f"the loss diverged at optimizer step {self.optimizer_steps}; lower lr or check "
                              "the log-prob replay (ratio metrics)")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        self.optimizer_steps += 1
        return norm

    # ----------------------------------------------------------------------------------- state

    def model_state_dict(self, dtype: torch.dtype | None = None, *,
                         staging: HostStaging | None = None) -> dict[str, Tensor]:
        """Full (unsharded) CPU weights to checkpoint: exactly the trainable parameters, or everything
        (parameters and persistent buffers) with weights_scope='full'. ``dtype``: the trainable parameters rounded to
        it (on the device, before the host copy, for the trainable scope; e.g. the compute dtype for a weights-only
        version); buffers and frozen parameters stay as they are. ``staging`` (a single-rank trainer): device tensors go
        into its reusable pinned buffers asynchronously (read them after ``staging.fence()``), not to new
        pageable memory synchronously.

        The trainable scope holds nothing else: no buffers (SD3's persistent ``pos_embed`` alone is
        ~13x a LoRA adapter at SD3.5-M shape) and no frozen tied names; a trainable tied weight appears
        under each of its names. Loading tolerates the missing frozen tensors (``load_model_state_dict``,
        ``load_policy_weights``: strict=False, every trainable name required).

        Collective under FSDP: every rank must call it; only rank 0 receives the tensors.
        """
        if self.cfg.weights_scope != "trainable":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # staging (one rank): the module's own device tensors, copied into the pinned buffers below
            opts = StateDictOptions(full_state_dict=True, cpu_offload=staging is None)
            state = get_model_state_dict(self.policy.module, options=opts)
            trained = {n for n, p in self.policy.module.named_parameters(remove_duplicate=False) if p.requires_grad}
            if staging is not None:
                return {k: staging.copy(k, rounded(v.detach(), dtype if k in trained else None))
                        for k, v in state.items()}
            return {k: rounded(v.detach(), dtype if k in trained else None).contiguous() for k, v in state.items()}
        # named_parameters, not state_dict: the names load_model_state_dict requires (the same under FSDP2,
        # whose parameters are DTensor shards: full_tensor gathers each, in module order on every rank)
        out: dict[str, Tensor] = {}
        for name, p in self.policy.module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            full = D.full_tensor(p.detach())
            if self.rank == 0:
                value = rounded(full, dtype)
                out[name] = (staging.copy(name, value) if staging is not None
                             else value.to("cpu").contiguous())
        return out

    def trainable_tensors(self) -> dict[str, Tensor]:
        """The trainable parameters as they are, on the trainer's device (no host copy): what
        :meth:`model_state_dict` returns with weights_scope='trainable', before its copy to the CPU. Single rank
        only (a sharded parameter is a shard); the caller must not keep them past the next step, which changes
        them in place."""
        if self.world_size > 1:
            raise field_error(ConfigError, "trainable_tensors", f"world size {self.world_size}", "world size 1",
                              "gather with model_state_dict() on every rank")
        return {name: D.full_tensor(p.detach()) for name, p in self.policy.module.named_parameters(
            remove_duplicate=False) if p.requires_grad}

    def load_model_state_dict(self, weights: dict[str, Tensor]) -> None:
        """Load weights written by :meth:`model_state_dict` (any world size); every saved name must exist."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        # state_dict keys, not named_parameters: tied weights (lm_head = embeddings) appear under both names
        names = set(names_in_order(self.policy.module))
        unknown = sorted(set(weights) - names)
        if unknown:
            raise field_error(CheckpointError, "weights", unknown[:5], "parameter names of this module",
                              "resume with the same model/LoRA layout the checkpoint was written with")
        shapes = {n: tuple(p.shape) for n, p in self.policy.module.named_parameters()}  # global shape under FSDP
        wrong = [(n, tuple(t.shape), shapes[n]) for n, t in weights.items() if n in shapes and
                 tuple(t.shape) != shapes[n]]
        if wrong:
            raise field_error(CheckpointError, "weights", wrong[:3], "the shapes of this module's parameters",
                              "resume with the same model config and LoRA rank the checkpoint was written with")
        missing = [n for n in self.param_names if n not in weights]
        if missing:
            raise field_error(CheckpointError, "weights", missing[:5], "a tensor for every trainable parameter",
                              "the checkpoint was written with another trainable layout")
        # Module order on every rank: safetensors returns keys in a per-process hash order, and under FSDP
        # each tensor is a scatter collective that all ranks must issue in the same sequence.
        ordered = {n: weights[n] for n in names_in_order(self.policy.module) if n in weights}
        if not self.sharded:
            # the saved names only: torch's set_model_state_dict loads every other tensor into itself, an in-place
            # write into the frozen base that a named pool's tenants share (``pool/frozen.py`` refuses any)
            with torch.no_grad():
                self.policy.module.load_state_dict(ordered, strict=False)
            return
        set_model_state_dict(self.policy.module, ordered,
                             options=StateDictOptions(full_state_dict=True, strict=False))

    def state_dict(self) -> dict[str, object]:
        """Optimizer (FQN-keyed, full), scheduler, scaler, EMA (full tensors), per-rank RNG and counters.

        Collective under FSDP; the optimizer state and EMA tensors are complete on rank 0.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self.optimizer.state:
            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            optim = get_optimizer_state_dict(self.policy.module, self.optimizer, options=opts)
        else:
            # No update yet (a step-0 version). torch's helper would first run one zero-gradient step of the live
            # optimizer to create AdamW's state (step 1, zero moments): written into the version and left in the
            # optimizer, it made the first real update bias-correct as AdamW's second (~0.74x its size).
            optim = {"state": {}, "param_groups": [
                {**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "params": names}
                for g, names in zip(self.optimizer.param_groups, self._param_group_names())]}
        ema = None
        if self.ema is not None:
            ema = {n: D.full_tensor(t).detach().cpu().contiguous() for n, t in self.ema.state_dict().items()}
        rng = capture_rng()
        if self.world_size > 1:
            gathered: list[object] = [None] * self.world_size
            dist.all_gather_object(gathered, rng)
            rng_all = gathered
        else:
            rng_all = [rng]
        return {"optimizer": optim, "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "ema": ema, "ema_num_updates": self.ema.num_updates if self.ema else 0, "rng": rng_all,
                "counters": {"step": self.step_count, "optimizer_steps": self.optimizer_steps,
                             "world_size": self.world_size}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore what :meth:`state_dict` captured; RNG is restored exactly when the world size matches."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        try:
            saved = state["optimizer"]
            positional = self._positional_optimizer_state(saved)
            if positional is not None:
                self.optimizer.load_state_dict(positional)
            else:
                set_optimizer_state_dict(self.policy.module, self.optimizer, saved,
                                         options=StateDictOptions(full_state_dict=True))
            self.scheduler.load_state_dict(state["scheduler"])
            if state["scaler"]:
                self.scaler.load_state_dict(state["scaler"])
            counters = state["counters"]
        except (KeyError, RuntimeError, ValueError) as e:
            raise field_error(CheckpointError, "train_state", type(e).__name__, "a state written by TrainBackend",
                              f"resume with the same trainable layout and optimizer ({e})") from e
        self._load_ema(state.get("ema"), int(state.get("ema_num_updates", 0)))
        self.step_count = int(counters["step"])
        self.optimizer_steps = int(counters["optimizer_steps"])
        rngs = state["rng"]
        if len(rngs) == self.world_size:
            restore_rng(rngs[self.rank])
        else:
            log.warning("checkpoint has RNG of %d ranks, job has %d: reseeding instead of restoring", len(rngs),
                        self.world_size)
            seed_everything(self.cfg.seed + self.rank + 1_000_003 * self.step_count)

    def _param_group_names(self) -> list[list[str]]:
        """The names (FQNs) of each optimizer param group's parameters, in order, as torch's helper keys them."""
        name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
        return [[name_of[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]

    def _positional_optimizer_state(self, saved: dict) -> dict | None:
        """``saved`` (FQN-keyed, full) keyed by position for ``Optimizer.load_state_dict``, or None when torch's
        ``set_optimizer_state_dict`` must load it (sharded parameters with state to scatter, or a parameter
        layout other than this backend's).

        Why not always torch's helper: on an optimizer without state it first runs one zero-gradient step to
        create that state (gradients + AdamW's moments + the kernel's temporaries, then replaced by the
        loaded ones): at ``qwen3-math``'s shape on an H200 that transient was the run's peak (13.1 GiB
        allocated inside it, 16,410 MiB in all, at the first rollout's restore of version 0). Loading by
        position allocates only the loaded state, and ends in the same ``Optimizer.load_state_dict`` call.
        """
        groups = saved["param_groups"]
        if [g["params"] for g in groups] != self._param_group_names():
            return None
        if saved["state"] and self.sharded:
            return None
        positional_groups, state, pos = [], {}, 0
        for g in groups:
            ids = list(range(pos, pos + len(g["params"])))
            for i, name in zip(ids, g["params"]):
                if name in saved["state"]:
                    state[i] = saved["state"][name]
            positional_groups.append({**g, "params": ids})
            pos += len(ids)
        return {"state": state, "param_groups": positional_groups}

    def _load_ema(self, ema: dict[str, Tensor] | None, num_updates: int) -> None:
        if self.ema is None:
            return
        if ema is None:
            raise field_error(CheckpointError, "ema", None, "EMA weights in the checkpoint",
                              "this run enables ema_decay but the checkpoint was written without EMA")
        local = {}
        for name, like in zip(self.ema.names, self.ema.shadow):
            if name in ema:
                local[name] = D.like_layout(ema[name], like)
        self.ema.load_state_dict(local, num_updates)
