"""TrainConfig: everything the train backend needs to turn a rollout batch into optimizer updates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from unirl_core.algorithms.base import OldLogpSource
from unirl_core.errors import ConfigError, field_error
from unirl_core.models.micro_batch import check_max_tokens

LRSchedule = Literal["constant", "cosine", "linear"]
ShardMode = Literal["auto", "never", "always"]
WeightsScope = Literal["trainable", "full"]
MasterWeights = Literal["fp32", "model"]
OptimizerImpl = Literal["auto", "foreach", "fused"]

_SCHEDULES = ("constant", "cosine", "linear")
_OLD_LOGP = ("rollout", "replay")


def _positive(name: str, value: float, fix: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise field_error(ConfigError, f"train.{name}", value, "a finite number > 0", fix)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimizer, schedule, batch geometry and sharding of one training job.

    Precision is not set here: the forward computes in the policy's model dtype (``model.dtype``) with fp32
    master copies of the trainable parameters, the same function the rollout runs (``models.precision``).
    """

    REMOVED_FIELDS: ClassVar[dict[str, str]] = {
        "mixed_precision": "remove it: the compute dtype is the model's dtype (diffusion.model.dtype / "
                           "lm.model.dtype, e.g. bfloat16); trainable weights always keep fp32 master copies"}

    lr: float = 1e-4
    """Peak learning rate of AdamW (reached after ``warmup_steps`` optimizer steps)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of AdamW (LoRA recipes usually keep 0)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    schedule: LRSchedule = "constant"
    """Shape after warmup: ``constant``, ``cosine`` or ``linear`` decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    total_steps: int | None = None
    """Optimizer steps of the whole run; required by ``cosine`` and ``linear``."""
    min_lr_ratio: float = 0.0
    """Floor of the decaying schedules as a fraction of ``lr``."""
    max_grad_norm: float | None = 1.0
    """Clip the global L2 norm of the gradients to this value; None disables clipping (the norm is still logged)."""
    micro_batch_size: int = 4
    """Samples per forward/backward; a rollout batch is cut into consecutive micro-batches in batch order."""
    micro_batch_tokens: int | None = None
    """LM only: pack micro-batches by padded tokens instead of a fixed count (verl's ``use_dynamic_bsz`` with
    ``ppo_max_token_len_per_gpu``): samples sorted by length, longest first, filled while
    ``rows x (longest prompt + longest response) <= micro_batch_tokens``; ``micro_batch_size`` is then unused.
    The trainside engine rescores over the same plan (``unirl_core.models.micro_batch``), so the first
    ratio stays exactly 1. None keeps fixed-count micro-batches."""
    num_updates_per_batch: int = 1
    """Optimizer updates per rollout batch (each a full pass of gradient accumulation over the batch)."""
    old_logp_source: OldLogpSource = "rollout"
    """pi_old: ``rollout`` uses the log-probs stored at sampling; ``replay`` recomputes them once, before the
    first update, over exactly the training micro-batches."""
    ema_decay: float | None = None
    """Keep an exponential moving average of the trainable parameters with this decay; None disables it.
    Enable it only when the algorithm samples or evaluates with EMA weights (GRPO must not)."""
    shard: ShardMode = "auto"
    """``auto`` applies FSDP2 ``fully_shard`` when the world size is above 1; ``never`` keeps a plain module;
    ``always`` shards even at world size 1 (a single-rank group is created if none exists) - to exercise
    the FSDP2 code path on one GPU."""
    fsdp_wrap_classes: tuple[str, ...] = ()
    """Class names of sub-modules (e.g. transformer blocks) that get their own FSDP2 unit before the root."""
    master_weights: MasterWeights = "fp32"
    """Dtype of the trainable weights the optimizer updates: ``fp32`` masters (cast to the model dtype per
    forward; AdamW state in fp32: 16 bytes per trainable parameter) or ``model``: the weights stay in the model
    dtype and so does the AdamW state (bf16: 8 bytes per parameter, TRL's ``bf16=True`` footprint). The forward
    is the same either way, so the first update stays exact; with ``model`` in bf16 an update smaller than half
    a bf16 step of a weight is lost (keep fp32 for small learning rates on large weights)."""
    optimizer_impl: OptimizerImpl = "auto"
    """AdamW kernel: ``foreach`` (a few multi-tensor kernels; its update allocates a temporary the size of the
    optimizer state's second moment), ``fused`` (one kernel, no temporary: on a full fine-tune the optimizer step
    peaks one copy of the trainable weights lower) or ``auto``: ``fused`` when every trainable parameter is on a
    CUDA device, else ``foreach`` (CPU runs keep their trajectories). The choice changes the update's last-bit
    rounding, never the forward, so the first update stays exact."""
    weights_scope: WeightsScope = "trainable"
    """What a checkpoint stores: ``trainable`` parameters only (a LoRA adapter) or the ``full`` state dict."""
    seed: int = 0
    """Seed of the backend's RNG state at construction (dropout, SDE noise inside the loss)."""

    def __post_init__(self) -> None:
        _positive("lr", self.lr, "use e.g. 1e-4 for LoRA, 1e-5 for full fine-tuning")
        _positive("eps", self.eps, "use 1e-8")
        b = tuple(self.betas)
        if len(b) != 2 or not all(0 <= x < 1 for x in b):
            raise field_error(ConfigError, "train.betas", self.betas, "two values in [0, 1)", "use (0.9, 0.999)")
        object.__setattr__(self, "betas", (float(b[0]), float(b[1])))
        object.__setattr__(self, "fsdp_wrap_classes", tuple(self.fsdp_wrap_classes))
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise field_error(ConfigError, "train.weight_decay", self.weight_decay, "a finite value >= 0", "use 0.0")
        self._check_schedule()
        self._check_batching()
        if self.ema_decay is not None and not (0 < self.ema_decay < 1):
            raise field_error(ConfigError, "train.ema_decay", self.ema_decay, "a value in (0, 1) or None",
                              "use e.g. 0.95, or None to disable EMA")
        if self.shard not in ("auto", "never", "always"):
            raise field_error(ConfigError, "train.shard", self.shard, "'auto', 'never' or 'always'", "use 'auto'")
        if self.master_weights not in ("fp32", "model"):
            raise field_error(ConfigError, "train.master_weights", self.master_weights, "'fp32' or 'model'",
                              "use 'fp32' (default), or 'model' to keep weights and AdamW state in the model dtype")
        if self.optimizer_impl not in ("auto", "foreach", "fused"):
            raise field_error(ConfigError, "train.optimizer_impl", self.optimizer_impl, "'auto', 'foreach' or 'fused'",
                              "use 'auto' (fused AdamW on CUDA, foreach elsewhere)")
        if self.weights_scope not in ("trainable", "full"):
            raise field_error(ConfigError, "train.weights_scope", self.weights_scope, "'trainable' or 'full'",
                              "use 'trainable' for LoRA, 'full' for full fine-tuning")

    def _check_schedule(self) -> None:
        if self.schedule not in _SCHEDULES:
            raise field_error(ConfigError, "train.schedule", self.schedule, f"one of {_SCHEDULES}",
                              "pick a supported learning-rate schedule")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise field_error(ConfigError, "train.warmup_steps", self.warmup_steps, "an integer >= 0", "use 0")
        if self.schedule != "constant":
            if not (isinstance(self.total_steps, int) and self.total_steps > self.warmup_steps):
                raise field_error(ConfigError, "train.total_steps", self.total_steps,
                                  f"an integer > warmup_steps={self.warmup_steps} for schedule={self.schedule!r}",
                                  "set total_steps = rollout steps x num_updates_per_batch")
        if not (0 <= self.min_lr_ratio <= 1):
            raise field_error(ConfigError, "train.min_lr_ratio", self.min_lr_ratio, "a value in [0, 1]", "use 0.0")
        if self.max_grad_norm is not None:
            _positive("max_grad_norm", self.max_grad_norm, "use 1.0, or None to disable clipping")

    def _check_batching(self) -> None:
        for name in ("micro_batch_size", "num_updates_per_batch"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise field_error(ConfigError, f"train.{name}", v, "an integer >= 1", "use e.g. 1")
        check_max_tokens(self.micro_batch_tokens, "train.micro_batch_tokens")
        if self.old_logp_source not in _OLD_LOGP:
            raise field_error(ConfigError, "train.old_logp_source", self.old_logp_source, f"one of {_OLD_LOGP}",
                              "use 'replay' when rollout and training batch shapes differ, else 'rollout'")
