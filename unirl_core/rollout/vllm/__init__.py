"""vLLM rollout engine: a vLLM server in its own process (own venv), token-in / token-out."""

from unirl_core.rollout.registry import register_engine
from unirl_core.rollout.vllm.config import VLLMEngineConfig, default_python
from unirl_core.rollout.vllm.engine import VLLMEngine

register_engine("vllm", config=VLLMEngineConfig, build=VLLMEngine, serves_initial_policy=True)

__all__ = ["VLLMEngine", "VLLMEngineConfig", "default_python"]
