"""Supervised warm start of the enhancer: teach a random-init LM to write prompts at all, before RL.

Completion cross-entropy (``sft.losses.CompletionSFT``, the SFT lifecycle's loss, on its own ``TrainBackend``) on
``prompt -> completion`` pairs (``warm_start.pairs``): the prompt encoded as the trainside engine encodes it, the
completion what the registered pairs say (``unirl_core.compose.warm_pairs``: the prompt itself, ``copy``, or e.g.
the prompt with a colour added, ``add_colour`` of ``examples/compose_enhance``) plus EOS. A short copy warm start
leaves a policy that copies imperfectly (sampled at temperature 1 it writes near-copies, other captions and word
salad), which is what RL then improves on: the reward is the image model's success on the ORIGINAL prompt, so any
rewrite that renders better is reinforced, copying or not. An ``add_colour`` warm start leaves one that adds a colour it picks at random; RL has
to find which one the reward wants.
"""

from __future__ import annotations

import logging

import torch

from unirl_core.compose.config import WarmStartConfig
from unirl_core.compose.warm_pairs import warm_pairs_entry
from unirl_core.models.lm import LMBundle
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.sft.losses import CompletionSFT
from unirl_core.sft.records import completion_segment
from unirl_core.train.backend import TrainBackend
from unirl_core.train.config import TrainConfig
from unirl_core.types import Part, PromptRecord, Sample, SampleBatch, TokenSegment

log = logging.getLogger(__name__)


def warm_pairs(records: list[PromptRecord], cfg: WarmStartConfig) -> list[tuple[str, str]]:
    """(prompt, completion) texts of the warm start, made by the registered ``cfg.pairs``."""
    return warm_pairs_entry(cfg.pairs).make(records, cfg)


def pair_segments(bundle: LMBundle, pairs: list[tuple[str, str]], engine: AREngineConfig) -> list[TokenSegment]:
    """One supervised segment per pair: engine-encoded prompt -> the completion's tokens + EOS."""
    encoder, tokenizer = TrainsideAREngine(bundle, engine), bundle.tokenizer
    return [completion_segment(encoder.encode_prompt(prompt), completion, tokenizer, tokenizer.eos_token_id)
            for prompt, completion in pairs]


def warm_start_enhancer(bundle: LMBundle, records: list[PromptRecord], cfg: WarmStartConfig,
                        engine: AREngineConfig) -> list[float]:
    """Train ``bundle`` in place for ``cfg.steps`` steps; returns the per-step losses (empty when steps is 0)."""
    if not cfg.steps:
        return []
    pairs = warm_pairs(records, cfg)
    segments = pair_segments(bundle, pairs, engine)
    backend = TrainBackend(bundle, CompletionSFT(), TrainConfig(lr=cfg.lr, micro_batch_size=cfg.batch_size,
                                                                max_grad_norm=1.0, seed=cfg.seed))
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    losses = []
    for step in range(cfg.steps):
        while len(order) < cfg.batch_size:
            order += torch.randperm(len(segments), generator=gen).tolist()
        idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
        samples = [Sample(sample_id=f"warm{step}/{k}", group_id=f"warm{step}/{k}", parts=[Part(
            kind="ar", sample_id=f"warm{step}/{k}", group_id=f"warm{step}/{k}", prompt=pairs[i][0],
            segment=segments[i])]) for k, i in enumerate(idx)]
        losses.append(backend.step(SampleBatch(samples=samples)).loss)
    log.info("enhancer warm start: %d steps, loss %.3f -> %.3f", cfg.steps, losses[0], losses[-1])
    return losses
