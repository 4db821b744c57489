"""Train backend: AdamW + schedule, clipping, mixed precision, EMA, micro-batching, FSDP2."""

from unirl_core.train.backend import TrainBackend, TrainMetrics
from unirl_core.train.config import TrainConfig
from unirl_core.train.distributed import DistInfo, init_distributed
from unirl_core.train.ema import ParameterEMA
from unirl_core.train.optim import lr_factor
from unirl_core.weightsync.sync import WeightReceiver, WeightSender, WeightSyncConfig

__all__ = ["DistInfo", "ParameterEMA", "TrainBackend", "TrainConfig", "TrainMetrics", "WeightReceiver",
           "WeightSender", "WeightSyncConfig", "init_distributed", "lr_factor"]
