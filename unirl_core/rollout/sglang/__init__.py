"""SGLang rollout engine (written against SGLang's documented HTTP API; SGLang has no CPU build)."""

from unirl_core.errors import ConfigError, field_error
from unirl_core.rollout.registry import register_engine
from unirl_core.rollout.sglang.config import SGLangEngineConfig
from unirl_core.rollout.sglang.engine import SGLangEngine


def _attach_only(config: SGLangEngineConfig) -> None:
    if config.base_url is None:
        raise field_error(ConfigError, "lm.sglang.base_url", None, "the URL of a running SGLang server",
                          "the loop attaches to SGLang but does not start it (SGLang has no CPU build and its "
                          "start-up path is untested here); start one as in the rollout README and set base_url")


register_engine("sglang", config=SGLangEngineConfig, build=SGLangEngine, check=_attach_only)

__all__ = ["SGLangEngine", "SGLangEngineConfig"]
