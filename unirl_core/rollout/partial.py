"""Partial rollouts for LMs: a generation interrupted by a weight update continues under the new weights.

Phase A sampled every completion up to ``t`` tokens with version ``v``; the rows that were still running (stopped
at the token limit) continue with the engine's current weights (version ``v + 1``): their ids so far are
appended to the prompt and decoding resumes for the remaining ``max_new_tokens - t`` tokens (a fresh prefill
under the new weights: the old KV cache is not reused, as AReaL does after an interruption). The behaviour
log-prob of each token is that of the policy that sampled it: phase A's (recorded under ``v``) for the first
``t`` tokens, the new weights' for the rest (rescored under them in ``rescore`` mode, over the whole sequence,
then sliced). Tokens sampled by the old policy are then either

- ``correct``: kept, with their own behaviour log-probs, for the loss's TIS / MIS weight ``pi_prox / pi_behav``;
- ``mask``: left out of the loss (``response_mask`` False), like tool output in agentic turns.

``Part.policy_version`` keeps ``v`` (the oldest policy in the completion: staleness is counted conservatively).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from unirl_core.errors import ConfigError, field_error
from unirl_core.models.text import decode_completions
from unirl_core.rollout.ar import TrainsideAREngine
from unirl_core.types import ARSamplingParams, Sample, SampleBatch, TokenSegment

OldTokens = Literal["mask", "correct"]


def continue_generation(engine: TrainsideAREngine, batch: SampleBatch, *, max_new_tokens: int,
                        generator: torch.Generator, old_tokens: OldTokens) -> tuple[SampleBatch, dict[str, float]]:
    """Continue the interrupted completions of ``batch`` (sampled up to their token limit) with ``engine``'s
    weights, up to ``max_new_tokens`` tokens each; returns the merged batch and ``rollout/partial_*`` metrics.

    Completions that stopped (EOS) before the interruption are kept as they are; under ``mask`` their tokens
    leave the loss too (all of them were sampled by the old policy)."""
    if old_tokens not in ("mask", "correct"):
        raise field_error(ConfigError, "partial_rollout.old_tokens", old_tokens, "'mask' or 'correct'", "pick one")
    parts = batch.generated
    segs: list[TokenSegment] = [p.segment for p in parts]
    running = [i for i, s in enumerate(segs) if s.finish_reason == "length" and s.num_response_tokens < max_new_tokens]
    merged = list(segs)
    if running:
        sp = parts[running[0]].sampling or ARSamplingParams()
        t = segs[running[0]].num_response_tokens
        if any(segs[i].num_response_tokens != t or (parts[i].sampling or ARSamplingParams()) != sp for i in running):
            raise field_error(ConfigError, "partial rollout batch", "mixed", "interrupted completions of one length "
                              "and sampling params", "interrupt one batch at one token count")
        rest = dataclasses.replace(sp, max_new_tokens=max_new_tokens - t)
        prompts = [torch.cat([segs[i].prompt_ids, segs[i].response_ids]) for i in running]
        module = engine.bundle.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), engine.bundle.compute():
                out = engine._decode(prompts, rest, generator)
                full = [TokenSegment(prompt_ids=segs[i].prompt_ids,
                                     response_ids=torch.cat([segs[i].response_ids, out.response_ids[j]]),
                                     log_probs=torch.cat([segs[i].log_probs, out.log_probs[j]]),
                                     response_mask=torch.ones(t + len(out.response_ids[j]), dtype=torch.bool),
                                     finish_reason=out.finish[j]) for j, i in enumerate(running)]
                if engine.config.logp_source == "rescore":
                    rescored = [dataclasses.replace(s) for s in full]
                    engine._rescore(rescored, [rest] * len(rescored))  # the new weights, whole sequences
                    for s, r in zip(full, rescored):
                        s.log_probs = torch.cat([s.log_probs[:t], r.log_probs[t:]])  # old tokens keep theirs
        finally:
            module.train(was_training)
        for j, i in enumerate(running):
            merged[i] = full[j]
    old_counts = [segs[i].num_response_tokens for i in range(len(segs))]
    if old_tokens == "mask":
        for i, s in enumerate(merged):
            mask = s.response_mask.clone()
            mask[:old_counts[i]] = False
            merged[i] = dataclasses.replace(s, response_mask=mask)
    texts = decode_completions(engine.bundle.tokenizer, [s.response_ids.tolist() for s in merged],
                               skip_ids=engine.bundle.eos_token_ids)
    samples = []
    for s, p, seg, text in zip(batch.samples, parts, merged, texts):
        sampling = dataclasses.replace(p.sampling or ARSamplingParams(), max_new_tokens=max_new_tokens)
        part = p.copy(segment=seg, text=text, sampling=sampling)
        samples.append(Sample(sample_id=s.sample_id, group_id=s.group_id,
                              parts=[part if q is p else q.copy() for q in s.parts]))
    total = sum(s.num_response_tokens for s in merged)
    metrics = {"rollout/partial_continued_frac": len(running) / max(len(segs), 1),
               "rollout/partial_old_token_frac": sum(old_counts) / max(total, 1)}
    return SampleBatch(samples=samples, metadata=dict(batch.metadata)), metrics
