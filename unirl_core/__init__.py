"""unirl_core: the RL post-training library (pure Python + torch, never flytekit)."""

__version__ = "0.1.0"
