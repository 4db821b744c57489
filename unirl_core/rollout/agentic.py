"""Agentic multi-turn rollouts: the trainside AR engine in a turn loop with an environment.

Per trajectory: the environment's first message (``Environment.reset``) is the prompt (chat template as the
single-turn engine applies it); then, turn by turn, the model samples until EOS / a stop string / the turn's
token cap, the decoded turn goes to ``Environment.step``, and its observation is appended as tokens of
``AgentConfig.observation_template`` (ChatML by default: the observation arrives as a user message and the
next assistant header is part of it). All trajectories of a batch advance together, one batched decode per turn.

The trajectory is ONE ``TokenSegment``: ``prompt_ids`` = the first message, ``response_ids`` = model and
environment tokens in order, ``response_mask`` True on model tokens only, so GRPO's loss (and its gradient)
never touches an environment token. Log-probs come from one full forward of the finished trajectories over
the trainer's micro-batch plan (``TrainsideAREngine.rescore``), so the first update's ratio is exactly 1 as in
single-turn GRPO; environment tokens carry their replayed log-probs too (nobody reads them: they are masked).

Per-turn structure travels in ``Part.conditions`` (Arrow-safe tensors, read by the deck):
``agent.turns`` int64 ``[K, 3]`` (role 0 = model / 1 = environment, start, end) over ``response_ids``,
``agent.text_spans`` int64 ``[K, 2]`` over ``Part.text`` (the transcript), ``agent.turn_rewards`` float32
``[K]`` (the step reward answering each model turn) and ``agent.finish`` int64 ``[1]`` (an index of
``AGENT_FINISH_REASONS``). The trajectory's return goes to ``targets['agent_return']`` for the
``agent_return`` scorer: the reward of the step that ended the episode plus ``shaping_weight`` times the sum
of the other step rewards. ``agent.turn_versions`` int64 ``[K]`` records the policy version that sampled each
turn (an environment turn: the version of the model turn it answers).

Turns come from a turn sampler (``agent_turns.py``): the trainside engine (rescored log-probs, exact replay) or
a vLLM engine (token ids in and out, the server's log-probs). Lagged (asynchronous) runs pass a ``TurnHook``:
before a turn it may suspend the batch at the boundary (the conversation state stays here, the weights may
change meanwhile) and resume it under another version; tokens keep the behaviour log-probs of the version that
sampled them (``stale_turns``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

import torch
from torch import Tensor

from unirl_core.env.base import EnvChoice, Environment, EnvTask, build_env
from unirl_core.env.reward import RETURN_TARGET
from unirl_core.errors import ConfigError, EngineError, check_ints, field_error
from unirl_core.models.text import decode_completion
from unirl_core.rollout.agent_turns import turn_sampler
from unirl_core.sde.noise import stable_seed
from unirl_core.types import (
    ARSamplingParams,
    NoiseRecipe,
    Sample,
    SampleBatch,
    TokenSegment,
)

log = logging.getLogger(__name__)

AgentFinish = Literal["done", "max_turns", "max_tokens", "env_error"]
AGENT_FINISH_REASONS: tuple[str, ...] = ("done", "max_turns", "max_tokens", "env_error")
SEGMENT_FINISH = {"done": "stop", "max_turns": "length", "max_tokens": "length", "env_error": "abort"}
"""The TokenSegment finish reason of each agent finish (``length`` marks truncation for
``mask_truncated_completions``)."""
TURNS_KEY, TEXT_SPANS_KEY, TURN_REWARDS_KEY, FINISH_KEY = ("agent.turns", "agent.text_spans", "agent.turn_rewards",
                                                            "agent.finish")
TURN_VERSIONS_KEY = "agent.turn_versions"
MODEL, ENV = 0, 1
CHATML_OBSERVATION = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Multi-turn rollouts of a GRPO run (``lm.agent``; None: single-turn)."""

    env: Annotated[Any, EnvChoice()]
    """The environment, picked by ``name`` from the registry (``unirl_core.env.register_env``; e.g. ``calculator``,
    ``guess_number`` of ``examples/agentic``); the other keys are its config fields."""
    max_turns: int = 4
    """Most model turns per trajectory; a trajectory still going after them ends with ``max_turns``."""
    max_response_tokens: int = 128
    """Most tokens after the prompt (model and environment together); ``lm.sampling.max_new_tokens`` caps
    each model turn. An observation that would leave no room for another turn ends it with ``max_tokens``."""
    observation_template: str = CHATML_OBSERVATION
    """How an observation becomes tokens (must contain ``{observation}``); the default closes the assistant
    turn's line, wraps the observation as a ChatML user message and opens the next assistant turn."""
    shaping_weight: float = 0.0
    """Weight of the non-final step rewards (per-turn shaping) in the trajectory return."""
    resume_version: Literal["pinned", "latest"] = "pinned"
    """Lagged runs (``async_training.max_policy_lag >= 1``): the version a trajectory suspended at a turn boundary
    (``quiesce``) resumes with. ``pinned``: the turn's pinned version (``switch_at_turn``), reproducible;
    ``latest``: the newest published one the step may train on (fresher, timing-dependent; the loop then
    suspends trajectories before every publication)."""
    switch_at_turn: int | None = None
    """Lagged runs, ``pinned``: turns from this index (0-based) on sample with version ``v + 1`` (the trajectory
    waits at that boundary for its publication); None: every turn samples with the rollout's version ``v``."""
    stale_turns: Literal["correct", "mask"] = "correct"
    """Lagged runs: model tokens of turns sampled by an older version than the trajectory's last one.
    ``correct``: they stay in the loss with their own behaviour log-probs (TIS / MIS weights, ``tis_cap``);
    ``mask``: they leave it (``response_mask`` False), like environment tokens."""

    def __post_init__(self) -> None:
        check_ints("lm.agent", self, ("max_turns",), "use e.g. 4 / 128")
        check_ints("lm.agent", self, ("max_response_tokens",), "use e.g. 4 / 128", minimum=2)
        if "{observation}" not in self.observation_template:
            raise field_error(ConfigError, "lm.agent.observation_template", self.observation_template,
                              "a template containing {observation}", f"use {CHATML_OBSERVATION!r}")
        if self.resume_version not in ("pinned", "latest"):
            raise field_error(ConfigError, "lm.agent.resume_version", self.resume_version, "'pinned' or 'latest'",
                              "use 'pinned' for reproducible runs")
        if self.stale_turns not in ("correct", "mask"):
            raise field_error(ConfigError, "lm.agent.stale_turns", self.stale_turns, "'correct' or 'mask'", "pick one")
        if self.switch_at_turn is not None and not (isinstance(self.switch_at_turn, int) and
                                                    not isinstance(self.switch_at_turn, bool) and
                                                    1 <= self.switch_at_turn < self.max_turns):
            raise field_error(ConfigError, "lm.agent.switch_at_turn", self.switch_at_turn,
                              f"None or an integer in [1, max_turns={self.max_turns})", "e.g. 1, or None")
        if self.switch_at_turn is not None and self.resume_version != "pinned":
            raise field_error(ConfigError, "lm.agent.switch_at_turn", self.switch_at_turn,
                              "None with resume_version='latest'", "a pinned switch needs resume_version 'pinned'")
        if not math.isfinite(self.shaping_weight):
            raise field_error(ConfigError, "lm.agent.shaping_weight", self.shaping_weight, "a finite number",
                              "use 0.0 (terminal reward only)")


class TurnHook(Protocol):
    """Lagged runs: may suspend a batch of trajectories at a turn boundary (``unirl_core/loop/agent_lagged.py``)."""

    def pause_before(self, turn: int) -> bool:
        """True to suspend before model turn ``turn`` (>= 1) of the trajectories still running."""

    def pause(self, turn: int) -> int:
        """Block while suspended; then the engine's weights are the version to resume with: returns it."""


@dataclass
class _Trajectory:
    env: Environment
    prompt_ids: Tensor
    sample_id: str = ""
    ids: list[Tensor] = field(default_factory=list)
    mask: list[Tensor] = field(default_factory=list)
    logps: list[Tensor] = field(default_factory=list)
    turns: list[tuple[int, int, int, str, float]] = field(default_factory=list)
    """(role, start, end, text, step reward) per turn."""
    versions: list[int] = field(default_factory=list)
    """Policy version of each turn (an environment turn: that of the model turn it answers)."""
    behaviour: dict[int, Tensor] = field(default_factory=dict)
    """Version -> log-probs of the tokens so far rescored under it when a suspension began (trainside)."""
    length: int = 0
    final_reward: float = 0.0
    shaping: float = 0.0
    finish: str | None = None

    def append(self, role: int, ids: Tensor, text: str, reward: float = 0.0, *, version: int,
               logps: Tensor | None = None) -> None:
        self.ids.append(ids)
        self.mask.append(torch.full((ids.numel(),), role == MODEL, dtype=torch.bool))
        self.logps.append(torch.zeros(ids.numel()) if logps is None else logps.float())
        self.turns.append((role, self.length, self.length + ids.numel(), text, reward))
        self.versions.append(version)
        self.length += ids.numel()

    def context(self) -> Tensor:
        return torch.cat([self.prompt_ids, *self.ids])


class AgenticEngine:
    """``RolloutEngine`` of multi-turn trajectories over a ``TrainsideAREngine`` or a ``VLLMEngine`` (see the
    module docstring)."""

    def __init__(self, engine, config: AgentConfig) -> None:
        self.engine = engine
        self.turns = turn_sampler(engine)
        self.config = config
        self.last_metrics: dict[str, float] = {}
        self._calls = 0  # mixed into the turn seeds: a reused engine does not repeat its draws

    @property
    def policy_version(self) -> int:
        return self.turns.policy_version

    def generate(self, batch: SampleBatch, *, noise: NoiseRecipe | None = None,
                 hook: TurnHook | None = None) -> SampleBatch:
        """Play every Part's episode; ``noise`` is unused (randomness comes from the turn seeds, so a suspended and
        resumed batch draws what an uninterrupted one would under the same weights). ``hook``: lagged runs."""
        parts = batch.generated
        trajs = []
        for i, p in enumerate(parts):
            if p.kind != "ar":
                raise field_error(EngineError, f"batch[{i}].generated.kind", p.kind, "'ar'",
                                  "agentic rollouts fill AR Parts")
            env = build_env(self.config.env)
            try:
                first = env.reset(EnvTask(prompt=p.prompt, targets=dict(p.targets), group_id=p.group_id))
            except Exception as e:  # a task the environment cannot play is a data error: fail the batch
                raise field_error(EngineError, f"batch[{i}] ({p.sample_id}) env.reset", type(e).__name__,
                                  "a task the environment can start", str(e)) from e
            trajs.append(_Trajectory(env=env, prompt_ids=self.turns.encode_prompt(first), sample_id=p.sample_id))
        sps = [p.sampling or ARSamplingParams() for p in parts]
        self._calls += 1
        suspensions = 0
        for turn in range(self.config.max_turns):
            active = [i for i, t in enumerate(trajs) if t.finish is None]
            if not active:
                break
            if hook is not None and turn > 0 and hook.pause_before(turn):
                self._record_behaviour(trajs, sps)  # under the weights that sampled them, before they change
                self.turns.policy_version = hook.pause(turn)
                suspensions += 1
            self._model_turn(trajs, active, sps, turn)
        segments = [self._segment(t) for t in trajs]
        self.turns.finish(segments, sps)
        stale = self._keep_behaviour(trajs, segments)
        self.last_metrics = {**_metrics(trajs), "agent/suspensions": float(suspensions),
                             "agent/stale_model_token_frac": stale}
        return self._fill(batch, trajs, segments)

    def _model_turn(self, trajs: list[_Trajectory], active: list[int], sps: list[ARSamplingParams], turn: int) -> None:
        cfg = self.config
        by_sp: dict[ARSamplingParams, list[int]] = {}
        for i in active:
            budget = min(sps[i].max_new_tokens, cfg.max_response_tokens - trajs[i].length)
            by_sp.setdefault(dataclasses.replace(sps[i], max_new_tokens=budget), []).append(i)
        tok = self.turns.tokenizer
        for sp, rows in by_sp.items():
            outs = self.turns.sample([trajs[i].context() for i in rows], sp, self._turn_seed(sp, turn),
                                     [trajs[i].sample_id for i in rows])
            for i, out in zip(rows, outs):
                t = trajs[i]
                text = decode_completion(tok, out.ids.tolist(), skip_ids=self.turns.eos_ids)
                try:
                    res = t.env.step(text)
                except Exception as e:  # noqa: BLE001 - an environment bug ends this trajectory, not the batch
                    log.warning("environment step failed (%s: %s); trajectory ends with env_error", type(e).__name__, e)
                    t.append(MODEL, out.ids, text, version=out.policy_version, logps=out.log_probs)
                    t.finish = "env_error"
                    continue
                t.append(MODEL, out.ids, text, float(res.reward), version=out.policy_version, logps=out.log_probs)
                self._after_step(t, res, turn)

    def _after_step(self, t: _Trajectory, res, turn: int) -> None:
        cfg = self.config
        if res.done:
            t.final_reward, t.finish = float(res.reward), "done"
            return
        t.shaping += float(res.reward)
        if turn + 1 >= cfg.max_turns:
            t.finish = "max_turns"
            return
        obs = self._encode_observation(res.observation)
        if t.length + obs.numel() >= cfg.max_response_tokens:
            t.finish = "max_tokens"
            return
        t.append(ENV, obs, res.observation, version=t.versions[-1])

    def _encode_observation(self, observation: str) -> Tensor:
        text = self.config.observation_template.format(observation=observation)
        ids = self.turns.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise field_error(ConfigError, "lm.agent.observation_template", self.config.observation_template,
                              "a template that encodes to >= 1 token", "add the role markers of the chat format")
        return torch.tensor(ids, dtype=torch.int64)

    def _turn_seed(self, sp: ARSamplingParams, turn: int) -> int | None:
        seed = self.turns.default_seed() if sp.seed is None else sp.seed
        if seed is None:
            return None
        # rows are sampled in groups of equal turn budget: each group draws from its own stream
        return stable_seed(seed, "agent-turn", self._calls, turn, sp.max_new_tokens)

    def _segment(self, t: _Trajectory) -> TokenSegment:
        ids = torch.cat(t.ids)
        return TokenSegment(prompt_ids=t.prompt_ids, response_ids=ids, log_probs=torch.cat(t.logps),
                            response_mask=torch.cat(t.mask), finish_reason=SEGMENT_FINISH[t.finish or "max_turns"])

    def _record_behaviour(self, trajs: list[_Trajectory], sps: list[ARSamplingParams]) -> None:
        """Before a suspension: rescore the tokens so far under the current weights (trainside; vLLM turns carry
        the server's log-probs already) and keep them as their behaviour log-probs should the version change."""
        if not self.turns.exact_rescore:
            return
        rows = [i for i, t in enumerate(trajs) if t.ids]
        segs = [self._segment(trajs[i]) for i in rows]
        self.turns.finish(segs, [sps[i] for i in rows])
        for i, seg in zip(rows, segs):
            trajs[i].behaviour[self.turns.policy_version] = seg.log_probs

    def _keep_behaviour(self, trajs: list[_Trajectory], segments: list[TokenSegment]) -> float:
        """Tokens of turns an older version sampled get that version's log-probs (``stale_turns: correct``) or
        leave the loss (``mask``); returns the share of model tokens sampled by an older version."""
        stale = total = 0
        for t, seg in zip(trajs, segments):
            newest = max(t.versions)
            for (role, a, b, _, _), v in zip(t.turns, t.versions):
                total += (b - a) * (role == MODEL)
                if v == newest:
                    continue
                if v in t.behaviour:
                    seg.log_probs[a:b] = t.behaviour[v][a:b]
                if role == MODEL:
                    stale += b - a
                    if self.config.stale_turns == "mask":
                        seg.response_mask[a:b] = False
        return stale / max(total, 1)

    def _fill(self, batch: SampleBatch, trajs: list[_Trajectory], segments: list[TokenSegment]) -> SampleBatch:
        samples = []
        for s, t, seg in zip(batch.samples, trajs, segments):
            finish = t.finish or "max_turns"
            text, spans = transcript(t.turns)
            ret = t.final_reward + self.config.shaping_weight * t.shaping
            conditions = {**s.generated.conditions,
                          TURNS_KEY: torch.tensor([[r, a, b] for r, a, b, _, _ in t.turns], dtype=torch.int64),
                          TEXT_SPANS_KEY: torch.tensor(spans, dtype=torch.int64),
                          TURN_REWARDS_KEY: torch.tensor([w for *_, w in t.turns], dtype=torch.float32),
                          TURN_VERSIONS_KEY: torch.tensor(t.versions, dtype=torch.int64),
                          FINISH_KEY: torch.tensor([AGENT_FINISH_REASONS.index(finish)], dtype=torch.int64)}
            # the oldest version in the trajectory: staleness is counted conservatively (as partial rollouts do)
            part = s.generated.copy(segment=seg, text=text, conditions=conditions, policy_version=min(t.versions))
            part.targets[RETURN_TARGET] = repr(float(ret))
            parts = [part if p is s.generated else p.copy() for p in s.parts]
            samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id, parts=parts))
        return SampleBatch(samples=samples, metadata=dict(batch.metadata))


def transcript(turns: list[tuple]) -> tuple[str, list[list[int]]]:
    """The conversation text (turns one per line) and each turn's ``[start, end)`` character span in it."""
    out, spans, pos = [], [], 0
    for turn in turns:
        text = turn[3]
        spans.append([pos, pos + len(text)])
        out.append(text)
        pos += len(text) + 1
    return "\n".join(out), spans


def agent_finish(part) -> str | None:
    """The agent finish reason of a Part an ``AgenticEngine`` filled (None for single-turn Parts)."""
    t = part.conditions.get(FINISH_KEY)
    return None if t is None else AGENT_FINISH_REASONS[int(t.reshape(-1)[0])]


def _metrics(trajs: list[_Trajectory]) -> dict[str, float]:
    n = max(len(trajs), 1)
    out = {"agent/model_turns_mean": sum(sum(r == MODEL for r, *_ in t.turns) for t in trajs) / n,
           "agent/env_tokens_frac": sum(int((~torch.cat(t.mask)).sum()) for t in trajs)
           / max(sum(t.length for t in trajs), 1),
           "agent/final_reward_mean": sum(t.final_reward for t in trajs) / n}
    for reason in AGENT_FINISH_REASONS:
        out[f"agent/finish_{reason}"] = sum(t.finish == reason for t in trajs) / n
    return out


def check_agent_config(cfg) -> None:
    """Refuse ``lm.agent`` where the loop cannot run it (called from ``RunConfig``; names the field and fix)."""
    agent = cfg.lm.agent if cfg.lm is not None else None
    if agent is None:
        return
    engine = cfg.lm.deployment.engine
    if engine not in ("trainside", "vllm"):
        raise field_error(ConfigError, "lm.deployment.engine", engine, "'trainside' or 'vllm' with lm.agent",
                          "multi-turn rollouts run over the trainside or the vLLM engine (an SGLang turn loop is "
                          "not built); remove lm.agent or use one of those")
    lag = cfg.async_training.max_policy_lag
    if lag > 0 and engine != "trainside":
        raise field_error(ConfigError, "async_training.max_policy_lag", lag, f"0 with lm.agent and "
                          f"lm.deployment.engine={engine!r}", "turn-boundary suspension is built for the trainside "
                          "engine only; use lag 0 or the trainside engine")
    if lag > 0 and cfg.async_training.partial_rollout is not None:
        raise field_error(ConfigError, "async_training.partial_rollout", "set", "unset with lm.agent",
                          "agentic trajectories change version at turn boundaries (lm.agent.switch_at_turn), not "
                          "mid-turn; remove the section")
    if lag > 0 and agent.switch_at_turn is not None and not cfg.async_training.overlap:
        raise field_error(ConfigError, "async_training.overlap", False, "True with lm.agent.switch_at_turn",
                          "the switch waits for the next publication on the sampler thread")


def check_agent_workflow(cfg) -> None:
    """Refuse what the Flyte DAG does not run: its rollout pods sample every turn with the pinned version (no
    sampler thread to suspend, no publication to wait for mid-rollout)."""
    agent = cfg.lm.agent if cfg.lm is not None else None
    if agent is None or cfg.async_training.max_policy_lag == 0:
        return
    if agent.switch_at_turn is not None:
        raise field_error(ConfigError, "lm.agent.switch_at_turn", agent.switch_at_turn, "None in the Flyte workflow",
                          "a version switch mid-rollout runs in run_local only; remove it (the lag itself is wired)")
    if agent.resume_version != "pinned":
        raise field_error(ConfigError, "lm.agent.resume_version", agent.resume_version, "'pinned' in the Flyte "
                          "workflow", "turn-boundary suspension runs in run_local only")


def conversation_segment(prompt_ids: Tensor, turns, *, tokenizer, eos_id: int | None, observation_template: str,
                         max_tokens: int) -> TokenSegment:
    """A supervised trajectory in the agentic engine's token layout (SFT warm starts): ``turns`` are
    ``(role, text)`` with role ``assistant`` (text + EOS, in the loss) or ``env`` (``observation_template``
    applied, masked out). Cut to ``max_tokens`` response tokens (finish ``length``)."""
    ids: list[int] = []
    mask: list[bool] = []
    for k, (role, text) in enumerate(turns):
        if role == "assistant":
            new = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + ([eos_id] if eos_id is not None else [])
        elif role == "env":
            new = list(tokenizer(observation_template.format(observation=text), add_special_tokens=False)["input_ids"])
        else:
            raise field_error(ConfigError, f"turns[{k}].role", role, "'assistant' or 'env'", "fix the record")
        ids += new
        mask += [role == "assistant"] * len(new)
    if not any(mask):
        raise field_error(ConfigError, "turns", [r for r, _ in turns], "at least one assistant turn",
                          "add the model's turns to the record")
    finish = "stop" if len(ids) <= max_tokens else "length"
    ids, mask = ids[:max_tokens], mask[:max_tokens]
    return TokenSegment(prompt_ids=prompt_ids, response_ids=torch.tensor(ids, dtype=torch.int64),
                        log_probs=torch.zeros(len(ids)), response_mask=torch.tensor(mask, dtype=torch.bool),
                        finish_reason=finish)
