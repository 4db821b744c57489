"""Environments of agentic rollouts: the contract, the registry, the sandbox of arithmetic tools and the return
scorer. The demo environments (calculator, guessing game) are ``examples/agentic``'s."""

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
