"""Agentic trajectories turn by turn (rollout decks and run reports): who said what, per-turn log-probs,
step rewards, the finish reason and the return.

Reads only what the agentic engine stored on the Part (``unirl_core.rollout.agentic``): the transcript in
``Part.text``, the turn spans in ``conditions`` and the per-token log-probs of the segment, so no tokenizer
is needed to render a batch read back from Arrow.
"""

from __future__ import annotations

import html

from unirl_core.report.text import display_html
from unirl_core.rollout.agentic import (
    MODEL,
    RETURN_TARGET,
    TEXT_SPANS_KEY,
    TURN_REWARDS_KEY,
    TURNS_KEY,
    agent_finish,
)
from unirl_core.types import Part, SampleBatch

_TABLE = "<table border='1' cellspacing='0' cellpadding='3' style='font-family:sans-serif;font-size:12px'>"


def is_agentic(part: Part) -> bool:
    return TURNS_KEY in part.conditions


def conversation_turns(part: Part) -> list[dict]:
    """One dict per turn: ``role`` (``model`` / ``env``), ``text``, ``tokens``, ``logp`` (sum of the recorded
    log-probs of a model turn; None for environment turns) and ``reward`` (the step reward a model turn got)."""
    turns = part.conditions[TURNS_KEY].tolist()
    spans = part.conditions[TEXT_SPANS_KEY].tolist()
    rewards = part.conditions[TURN_REWARDS_KEY].tolist()
    lp = part.segment.log_probs if part.segment is not None else None
    out = []
    for (role, a, b), (ca, cb), w in zip(turns, spans, rewards):
        model = role == MODEL
        out.append({"role": "model" if model else "env", "text": (part.text or "")[ca:cb], "tokens": b - a,
                    "logp": float(lp[a:b].sum()) if model and lp is not None else None,
                    "reward": w if model else None})
    return out


def conversations_html(batch: SampleBatch, *, max_samples: int = 16) -> str:
    """The first ``max_samples`` agentic trajectories of ``batch`` as one table each ("" when none is agentic)."""
    parts = [(s.sample_id, s.generated) for s in batch.samples if is_agentic(s.generated)]
    if not parts:
        return ""
    blocks = [f"<h3>conversations: {min(len(parts), max_samples)} of {len(parts)} trajectories</h3>"]
    for sid, p in parts[:max_samples]:
        ret = p.targets.get(RETURN_TARGET, "")
        head = (f"<h4>{html.escape(sid)} - finish {html.escape(agent_finish(p) or '?')}, return "
                f"{html.escape(ret)}, reward {'' if p.reward is None else f'{p.reward:.4g}'}, advantage "
                f"{'' if p.advantage is None else f'{p.advantage:.4g}'}</h4>")
        rows = [f"<tr><td>prompt</td><td>{display_html(p.prompt, 400)}</td><td></td><td></td><td></td></tr>"]
        for k, t in enumerate(conversation_turns(p)):
            logp = "" if t["logp"] is None else f"{t['logp']:.4g}"
            reward = "" if t["reward"] is None else f"{t['reward']:.4g}"
            rows.append(f"<tr class='turn-{t['role']}'><td>{k}: {t['role']}</td><td>{display_html(t['text'], 400)}"
                        f"</td><td>{t['tokens']}</td><td>{logp}</td><td>{reward}</td></tr>")
        blocks.append(head + _TABLE.replace("<table ", "<table class='conversation' ")
                      + "<tr><th>turn</th><th>text</th><th>tokens</th><th>log-prob</th><th>step reward</th></tr>"
                      + "".join(rows) + "</table>")
    return "".join(blocks)
