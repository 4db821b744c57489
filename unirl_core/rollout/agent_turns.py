"""Turn samplers of the agentic engine: one model turn for many token contexts, on the trainside or a vLLM engine.

``AgenticEngine`` (``agentic.py``) owns the episode (environment, masks, turn structure); a turn sampler owns how
the model's next turn is drawn and where its log-probs come from:

- ``TrainsideTurns``: ``TrainsideAREngine.decode_ids`` per turn (one generator per turn, seeded from the turn
  seed); the recorded log-probs come from ONE rescoring forward of the finished trajectories over the trainer's
  micro-batch plan (``finish``), so the first update's ratio is exactly 1.
- ``VLLMTurns``: each context goes to vLLM's ``/inference/v1/generate`` as token ids (token in, token out: the
  server conditions on exactly the ids the trainer replays, environment tokens included); a turn's log-probs
  are the server's processed log-probs of the sampled tokens (the behaviour policy; the loop checks them
  against the trainer's replay with ``lm.logp_check``) and its policy version is the server's weight label.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from unirl_core.errors import EngineError, field_error
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.rollout.dedicated import encode_prompt, request_seed
from unirl_core.types import ARSamplingParams, TokenSegment


@dataclass(kw_only=True)
class TurnOut:
    """One sampled model turn."""

    ids: Tensor
    """Sampled token ids ``[R]`` int64 (EOS included when the turn ended on it)."""
    log_probs: Tensor
    """Behaviour log-probs ``[R]`` fp32 (trainside: decode-time, replaced by ``finish``'s rescore)."""
    policy_version: int
    """The weights that sampled the turn."""


class TrainsideTurns:
    """Turns from the trainside AR engine; ``finish`` rescores the whole trajectories (exact replay)."""

    exact_rescore = True

    def __init__(self, engine: TrainsideAREngine) -> None:
        self.engine = engine

    @property
    def tokenizer(self):
        return self.engine.bundle.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.bundle.eos_token_ids)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.engine.policy_version = int(version)

    def default_seed(self) -> int:
        return self.engine.config.seed

    def encode_prompt(self, text: str) -> Tensor:
        return self.engine.encode_prompt(text)

    def sample(self, contexts: Sequence[Tensor], sp: ARSamplingParams, turn_seed: int,
               sample_ids: Sequence[str]) -> list[TurnOut]:
        dev = next(self.engine.bundle.module.parameters()).device
        gen = torch.Generator(device=dev).manual_seed(turn_seed)
        outs = self.engine.decode_ids(list(contexts), sp, gen)
        return [TurnOut(ids=ids, log_probs=lp, policy_version=self.engine.policy_version) for ids, lp, _ in outs]

    def finish(self, segments: list[TokenSegment], sps: Sequence[ARSamplingParams]) -> None:
        """Set every segment's log-probs to the trainer's replay under the engine's current weights."""
        self.engine.rescore(segments, sps)


class VLLMTurns:
    """Turns from a vLLM server (token ids in and out); log-probs and versions are the server's."""

    exact_rescore = False

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.eos_ids)

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def default_seed(self) -> int | None:
        return None  # unseeded requests: the server's own stream

    def encode_prompt(self, text: str) -> Tensor:
        return encode_prompt(self.engine.tokenizer, text, self.engine.config.prompt)

    def sample(self, contexts: Sequence[Tensor], sp: ARSamplingParams, turn_seed: int | None,
               sample_ids: Sequence[str]) -> list[TurnOut]:
        from unirl_core.rollout.vllm.engine import sampling_body

        eng, limit = self.engine, self.engine.config.max_model_len
        tag = uuid.uuid4().hex[:8]
        seeded = dataclasses.replace(sp, seed=turn_seed)
        bodies = []
        for i, (ctx, sid) in enumerate(zip(contexts, sample_ids)):
            if ctx.numel() + sp.max_new_tokens > limit:
                raise field_error(EngineError, f"agent turn of {sid}: context + turn tokens",
                                  ctx.numel() + sp.max_new_tokens, f"<= vllm.max_model_len={limit}",
                                  "raise lm.vllm.max_model_len or lower lm.agent.max_response_tokens")
            bodies.append({"token_ids": ctx.tolist(), "model": eng.request_model,
                           "output_mode": "tokens", "request_id": f"{sid}@v{eng.policy_version}-{tag}-{i}",
                           "sampling_params": sampling_body(seeded, request_seed(seeded, sid),
                                                            ignore_eos=eng.config.ignore_eos)})
        done = eng.post_generate(bodies)
        stale = [(i, c.policy_version) for i, c in enumerate(done) if c.policy_version != eng.policy_version]
        if stale:
            raise field_error(EngineError, "served policy_version", stale[:5], f"{eng.policy_version} everywhere",
                              "another client updated this server; give each engine its own server or publisher")
        outs = []
        for i, c in enumerate(done):
            if len(c.response_ids) != len(c.log_probs):
                raise field_error(EngineError, f"vllm agent turn[{i}].log_probs", (len(c.response_ids),
                                  len(c.log_probs)), "one log-prob per sampled token", "request logprobs=0")
            outs.append(TurnOut(ids=torch.tensor(c.response_ids, dtype=torch.int64),
                                log_probs=torch.tensor(c.log_probs, dtype=torch.float32),
                                policy_version=c.policy_version))
        return outs

    def finish(self, segments: list[TokenSegment], sps: Sequence[ARSamplingParams]) -> None:
        """Nothing: the segments already hold the server's per-turn log-probs (environment tokens 0, masked)."""


def turn_sampler(engine) -> TrainsideTurns | VLLMTurns:
    """The turn sampler of a rollout engine (trainside AR or vLLM)."""
    if isinstance(engine, TrainsideAREngine):
        return TrainsideTurns(engine)
    from unirl_core.rollout.vllm.engine import VLLMEngine

    if isinstance(engine, VLLMEngine):
        return VLLMTurns(engine)
    raise field_error(EngineError, "agentic engine", type(engine).__name__, "TrainsideAREngine or VLLMEngine",
                      "multi-turn rollouts run over the trainside or the vLLM engine (SGLang: not built)")
