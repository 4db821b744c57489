"""Agentic conversations in the rollout deck: turn by turn, from what the Part stores (also after Arrow)."""

from examples.agentic.guess import GuessNumberEnvConfig
from unirl_core.io import read_batch, write_batch
from unirl_core.models.lm import build_tiny_lm
from unirl_core.report.conversation import conversation_turns, conversations_html
from unirl_core.report.phase_html import rollout_html
from unirl_core.rollout.agentic import AgentConfig, AgenticEngine
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


def _batch():
    bundle = build_tiny_lm(seed=0)
    engine = AgenticEngine(TrainsideAREngine(bundle, AREngineConfig(forward_batch_size=2)),
                           AgentConfig(env=GuessNumberEnvConfig(high=1000), max_turns=3, max_response_tokens=200))
    req = SampleBatch.from_prompts([PromptRecord(prompt_id="p0", prompt="Play.")], samples_per_prompt=2, kind="ar",
                                   sampling=ARSamplingParams(max_new_tokens=6, seed=1))
    return engine.generate(req)


def test_turns_and_deck(tmp_path):
    batch = _batch()
    write_batch(batch, tmp_path / "b.arrow")
    back = read_batch(tmp_path / "b.arrow")
    for part in back.generated:
        turns = conversation_turns(part)
        assert [t["role"] for t in turns][:3] == ["model", "env", "model"]
        assert sum(t["tokens"] for t in turns) == part.segment.num_response_tokens
        model = [t for t in turns if t["role"] == "model"]
        assert abs(sum(t["logp"] for t in model) - float(part.segment.log_probs[part.segment.response_mask].sum())) < 1e-4
        assert all(t["text"].startswith("error:") or t["text"] in ("higher", "lower")
                   for t in turns if t["role"] == "env")
    page = rollout_html(back, {"rollout/seconds": 0.1})
    assert "conversations: 2 of 2 trajectories" in page and page.count("class='turn-env'") >= 2
    assert "finish max_turns" in page and "p0/1" in page
    single = SampleBatch.from_prompts([PromptRecord(prompt_id="q", prompt="x")], samples_per_prompt=1, kind="ar",
                                      sampling=ARSamplingParams())
    assert conversations_html(single) == ""
