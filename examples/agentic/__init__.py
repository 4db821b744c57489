"""Agentic environments: a sandboxed calculator tool and a guess-the-number game, for multi-turn GRPO.

Registers the environments ``calculator`` and ``guess_number`` (``lm.agent.env: {name: ...}``) and the SFT record
source ``calc_tool`` (the warm start's tool-call conversations); recipes ``sft-agent-calc`` (sft), ``tiny-agent-calc``
and ``tiny-agent-calc-vllm`` (rl). See README.md."""

from examples.agentic import calculator, guess
from examples.agentic.sft import CalcToolRecordsConfig
from unirl_core.sft.sources import register_record_source

register_record_source("calc_tool", section="calc", config=CalcToolRecordsConfig,
                       build="examples.agentic.sft:calc_records", families=("lm",))

__all__ = ["calculator", "guess"]
