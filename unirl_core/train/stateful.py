"""What a ``TrainBackend`` hands the checkpoint package, and takes back from it: the methods of
``unirl_core.checkpoint.stateful.TrainState`` / ``ShardedTrainState``. The checkpoint package never imports
train/; it saves and restores whatever implements these."""

from __future__ import annotations

import torch
from torch import Tensor

from unirl_core.checkpoint.rng import capture_rng, restore_rng, seed_everything
from unirl_core.models.precision import rounded
from unirl_core.train import distributed as D


class CheckpointableState:
    """Mixed into ``TrainBackend`` (which owns ``policy``, ``optimizer``, ``scheduler``, ``scaler``, ``ema``,
    ``cfg``, the counters and the rank)."""

    @property
    def weights_scope(self) -> str:
        """``trainable`` (LoRA adapters, a partial fine-tune) or ``full``: what a version's weights file holds."""
        return self.cfg.weights_scope

    def live_tensors(self) -> list[Tensor]:
        """What the next step (or EMA update) changes in place: module parameters and buffers, optimizer state
        (AdamW's ``step`` counters stay on the CPU even on a GPU), EMA shadows - the tensors a background write
        must snapshot before training goes on."""
        module = self.policy.module
        out = [*module.parameters(), *module.buffers()]
        out += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        if self.ema is not None:
            out += [t for t in self.ema.state_dict().values() if isinstance(t, torch.Tensor)]
        return out

    def ema_weights(self, dtype: torch.dtype) -> dict[str, Tensor] | None:
        """The EMA weights as full CPU tensors (collective under FSDP), rounded to ``dtype``; None without EMA."""
        if self.ema is None:
            return None
        return {n: rounded(D.full_tensor(t).detach(), dtype).cpu().contiguous()
                for n, t in self.ema.state_dict().items()}

    def apply_config_hyperparameters(self) -> None:
        """Make the run's ``TrainConfig``, not a restored state, set AdamW's lr / betas / eps / weight_decay.

        ``load_state_dict`` restores the optimizer's param_groups and the scheduler's ``base_lrs`` as they were
        when the version was written, so a resume with a changed ``train.lr`` would keep training at the old
        rate while the new version's config.json records the new one. The schedule's position (``last_epoch``)
        stays restored; the next lr is ``cfg.lr * factor(last_epoch)``, the very expression LambdaLR evaluates,
        so an unchanged config rewrites identical values and resume stays bit-exact.
        """
        cfg, optimizer, scheduler = self.cfg, self.optimizer, self.scheduler
        groups = optimizer.param_groups
        factors = [fn(scheduler.last_epoch) for fn in scheduler.lr_lambdas]
        for group, factor in zip(groups, factors, strict=True):
            group.update(initial_lr=cfg.lr, lr=cfg.lr * factor, betas=tuple(cfg.betas), eps=cfg.eps,
                         weight_decay=cfg.weight_decay)
        scheduler.base_lrs = [cfg.lr] * len(groups)
        scheduler._last_lr = [group["lr"] for group in groups]

    # -- the sharded state (torch.distributed.checkpoint) ----------------------------------------------------------
    def sharded_tensors(self) -> dict[str, object]:
        """The sharded tensor state DCP writes / loads in place: module and optimizer (FQN-keyed DTensor shards
        under FSDP2, plain tensors at world 1) and the EMA shadows."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.policy.module, self.optimizer)
        out: dict[str, object] = {"model": model, "optim": optim}
        if self.ema is not None:
            out["ema"] = self.ema.state_dict()
        return out

    def small_state(self, rank: int) -> dict[str, object]:
        """This rank's RNG; rank 0 also scheduler, scaler, EMA update count and counters."""
        state: dict[str, object] = {"rng": capture_rng()}
        if rank == 0:
            state.update(scheduler=self.scheduler.state_dict(), scaler=self.scaler.state_dict(),
                         ema_num_updates=self.ema.num_updates if self.ema else 0,
                         counters={"step": self.step_count, "optimizer_steps": self.optimizer_steps})
        return state

    def load_sharded(self, tensors: dict[str, object], small0: dict[str, object],
                     mine: dict[str, object] | None) -> None:
        """Take back what ``sharded_tensors`` (loaded in place by DCP) and ``small_state`` held: rank 0's
        ``small0``, and this rank's own (``mine``; None when the world size changed: RNG is reseeded)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.policy.module, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optim"])
        self.scheduler.load_state_dict(small0["scheduler"])
        if small0["scaler"]:
            self.scaler.load_state_dict(small0["scaler"])
        if self.ema is not None:
            self.ema.load_state_dict(tensors["ema"], int(small0["ema_num_updates"]))
        self.step_count = int(small0["counters"]["step"])
        self.optimizer_steps = int(small0["counters"]["optimizer_steps"])
        if mine is not None:
            restore_rng(mine["rng"])
        else:
            seed_everything(self.cfg.seed + self.rank + 1_000_003 * self.step_count)
