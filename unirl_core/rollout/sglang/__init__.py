"""SGLang rollout engine (written against SGLang's documented HTTP API; SGLang has no CPU build)."""

from unirl_core.rollout.sglang.config import SGLangEngineConfig
from unirl_core.rollout.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine", "SGLangEngineConfig"]
