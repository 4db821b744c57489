"""The state the phases change, with one owner: the rollout bundles, the trainer and the dedicated engine.

An executor (``runtime.inprocess``, ``compose.executor``) or a pool actor owns one ``Resources``; nothing else keeps
them. Within one owner a bundle is built once per model config and only its weights are reloaded from the version
a phase is given; the trainer once per model / train / loss config (one at a time: a model copy plus optimizer
state each); the dedicated engine is started on first use and kept while its config stays (a server start costs
~1 min, a weight sync ~0.1 s on the tiny model), stopped by ``close`` or at interpreter exit.
"""

from __future__ import annotations

import atexit
import gc
import weakref

from unirl_core.config.loader import config_key
from unirl_core.config.run import RunConfig
from unirl_core.runtime import build
from unirl_core.runtime.build import (
    EngineSlot,
    algorithm,
    engine_key,
    start_engine,
    stop_engine,
    train_bundle,
)
from unirl_core.train.backend import TrainBackend


class Resources:
    """Rollout bundles, one trainer and at most one dedicated engine, built on first use."""

    def __init__(self) -> None:
        self._bundles: dict[str, object] = {}
        self._trainers: dict[str, TrainBackend] = {}
        self._engine: EngineSlot | None = None
        ref = weakref.ref(self)
        atexit.register(lambda: (r := ref()) is not None and r.close_engines())

    def bundle(self, cfg: RunConfig):
        """The rollout bundle (a Policy) for ``cfg``'s model. Its trainable weights are whatever the last phase
        loaded: always load a version into it before use."""
        key = f"{cfg.family}:{config_key(cfg.section.model)}"
        if key not in self._bundles:
            # through the module: the one builder every phase uses (a benchmark's shaped builder replaces it there)
            self._bundles[key] = build.fresh_bundle(cfg)
        return self._bundles[key]

    def trainer(self, cfg: RunConfig) -> TrainBackend:
        """The train backend: a bundle of its own (never ``bundle(cfg)``, which the rollout samples with). Restore a
        version into it before every step: it holds whatever the last train phase left."""
        key = f"{cfg.family}:{config_key(cfg.section.model)}:{config_key(cfg.train)}:{config_key(cfg.section.algorithm)}"
        if key not in self._trainers:
            if self._trainers:
                self._trainers.clear()  # one trainer at a time: a model copy plus optimizer state each
                gc.collect()  # the old one sits in reference cycles: free its device memory before building the new
            self._trainers[key] = TrainBackend(train_bundle(cfg), algorithm(cfg), cfg.train)
        return self._trainers[key]

    def forget_trainer(self) -> None:
        """Drop the trainer (a new process would have none): the next ``trainer`` builds one."""
        self._trainers.clear()

    def dedicated_engine(self, cfg: RunConfig, policy) -> EngineSlot:
        """The engine of ``cfg.lm.deployment``, started on first use; another engine config stops the old one."""
        key = engine_key(cfg)
        if self._engine is not None and self._engine.key == key:
            return self._engine
        self.close_engines()
        self._engine = start_engine(cfg, policy)
        return self._engine

    def close_engines(self) -> None:
        """Stop the dedicated engine (its server, when the engine started one). Idempotent."""
        slot, self._engine = self._engine, None
        if slot is not None:
            stop_engine(slot)
