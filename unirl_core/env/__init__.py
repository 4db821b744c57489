"""Environments of agentic rollouts: the contract, the registry and the built-in calculator / guessing game."""

from unirl_core.env.base import (
    EnvChoice,
    Environment,
    EnvTask,
    StepResult,
    build_env,
    env_entry,
    env_names,
    register_env,
)

__all__ = ["EnvChoice", "EnvTask", "Environment", "StepResult", "build_env", "env_entry", "env_names",
           "register_env"]
