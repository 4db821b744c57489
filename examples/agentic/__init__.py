"""Agentic environments: a sandboxed calculator tool and a guess-the-number game, for multi-turn GRPO.

Registers the environments ``calculator`` and ``guess_number`` (``lm.agent.env: {name: ...}``); recipes
``tiny-agent-calc`` and ``tiny-agent-calc-vllm`` (rl). See README.md."""

from examples.agentic import calculator, guess

__all__ = ["calculator", "guess"]
