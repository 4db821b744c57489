"""Dedicated-engine plumbing without a server: prompts, seeds, vLLM wire parsing, weight staging,
the tied-head refresh of the vLLM worker extension, and the managed server process."""

import json
import os
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch
from torch import nn

from unirl_core.checkpoint import CheckpointStore
from unirl_core.errors import CheckpointError, ConfigError, EngineError
from unirl_core.models.lm import build_tiny_lm
from unirl_core.models.lora import lora_state_dict
from unirl_core.rollout.ar import AREngineConfig, TrainsideAREngine
from unirl_core.rollout.dedicated import PromptFormat, encode_prompt, request_seed
from unirl_core.rollout.server import HTTPJSONClient, ManagedServer, reserve_port
from unirl_core.rollout.vllm import VLLMEngineConfig
from unirl_core.rollout.vllm.engine import parse_completion, sampling_body, server_argv
from unirl_core.rollout.vllm.worker_ext import _refresh_tied_lm_head
from unirl_core.rollout.weights import stage_state_dict, stage_weights
from unirl_core.types import ARSamplingParams


@pytest.fixture(scope="module")
def bundle():
    return build_tiny_lm(seed=0, keep_reference=False)


@pytest.mark.parametrize("template", [None, False])
def test_prompt_ids_match_the_trainside_engine(bundle, template):
    side = TrainsideAREngine(bundle, AREngineConfig(apply_chat_template=template, system_prompt="Be brief."))
    fmt = PromptFormat(apply_chat_template=template, system_prompt="Be brief.")
    for prompt in ("What is 3 + 4?", "x"):
        assert encode_prompt(bundle.tokenizer, prompt, fmt).tolist() == side.encode_prompt(prompt).tolist()


def test_request_seed_is_stable_and_differs_between_siblings():
    sp = ARSamplingParams(seed=5)
    assert request_seed(sp, "p0/0") == request_seed(sp, "p0/0")
    assert len({request_seed(sp, f"p0/{k}") for k in range(8)}) == 8
    assert request_seed(ARSamplingParams(), "p0/0") is None
    assert 0 <= request_seed(sp, "p0/1") < 2**63


def _resp(ids, logps, versions, finish="length"):
    return {"choices": [{"token_ids": ids, "finish_reason": finish,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logps)]},
                         "weight_versions": [{"version": v, "start": 0, "end": len(ids)} for v in versions]}]}


def test_parse_vllm_completion():
    c = parse_completion(_resp([4, 5, 2], [-1.0, -2.0, -0.5], ["7"], finish="stop"), "r")
    assert (c.response_ids, c.log_probs, c.policy_version, c.finish_reason) == ([4, 5, 2], [-1.0, -2.0, -0.5], 7,
                                                                                 "stop")
    with pytest.raises(EngineError, match="exactly one weight version"):
        parse_completion(_resp([4, 5], [-1.0, -2.0], ["1", "2"]), "r")
    with pytest.raises(EngineError, match="integer policy version"):
        parse_completion(_resp([4], [-1.0], ["default"]), "r")
    with pytest.raises(EngineError, match="finish_reason"):
        parse_completion(_resp([4], [-1.0], ["1"], finish="weird"), "r")
    with pytest.raises(EngineError, match="a generate response"):
        parse_completion({"choices": []}, "r")


def test_vllm_request_and_server_flags():
    sp = ARSamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=9, stop=("\n",))
    assert sampling_body(sp, 3) == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 9, "logprobs": 0,
                                    "detokenize": True, "stop": ["\n"], "seed": 3}
    argv = server_argv(VLLMEngineConfig(model="m", weight_sync="lora", max_lora_rank=8), "py", 1234)
    joined = " ".join(argv)
    for flag in ("--logprobs-mode processed_logprobs", "--enable-scale-out", "--port 1234", "--enable-lora",
                 "--max-lora-rank 8", "--worker-extension-cls unirl_core.rollout.vllm.worker_ext.WeightSyncExtension"):
        assert flag in joined
    with pytest.raises(ConfigError, match="vllm.extra_args"):
        VLLMEngineConfig(model="m", extra_args=("--logprobs-mode=raw_logprobs",))
    with pytest.raises(ConfigError, match="vllm.base_url"):
        VLLMEngineConfig(model="m", base_url="localhost:8000")
    with pytest.raises(ConfigError, match="vllm.weight_sync"):
        VLLMEngineConfig(model="m", weight_sync="nccl")


def test_stage_weights_from_refs_and_folders(tmp_path, bundle):
    bundle.save_pretrained(tmp_path / "base")
    store = CheckpointStore(str(tmp_path / "ckpt"), "run")
    full = {k: v.detach().clone() for k, v in bundle.module.state_dict().items()}
    ref = store.save(1, weights=full, policy_version=1)
    out = stage_weights(ref, want="full", staging=tmp_path / "stage", policy_version=1,
                        base_model=str(tmp_path / "base"))
    assert (out / "config.json").exists()
    loaded = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert torch.equal(loaded["model.embed_tokens.weight"], full["model.embed_tokens.weight"])
    assert stage_weights(tmp_path / "base", want="full", staging=tmp_path / "s", policy_version=2) == \
        (tmp_path / "base").resolve()
    with pytest.raises(ConfigError, match="policy_version"):
        stage_weights(ref, want="full", staging=tmp_path / "stage", policy_version=2)
    with pytest.raises(ConfigError, match="weight_sync='reload'"):  # full weights sent to an adapter engine
        stage_weights(ref, want="lora", staging=tmp_path / "stage", policy_version=1, lora_alpha=8.0)
    with pytest.raises(CheckpointError, match="an existing directory"):
        stage_weights(tmp_path / "nope", want="full", staging=tmp_path / "s", policy_version=0)


def test_stage_state_dict_takes_a_trainers_dict_with_a_tied_head(tmp_path, bundle):
    """The pool's vLLM engine actor stages the trainer's ``model_state_dict`` from memory: a tied LM head names the
    embedding's tensor twice, which safetensors refuses unless one name gets a copy."""
    bundle.save_pretrained(tmp_path / "base")
    emb = torch.randn(5, 3)
    weights = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.ones(3)}
    out = stage_state_dict(weights, want="full", staging=tmp_path / "stage", policy_version=3,
                           base_model=str(tmp_path / "base"), where="trainer")
    assert out == tmp_path / "stage" / "policy-v00000003" and (out / "config.json").exists()
    loaded = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert weights["lm_head.weight"] is emb  # the caller's dict is not changed
    with pytest.raises(ConfigError, match="weights trainer='full'.*weight_sync='reload'"):
        stage_state_dict(weights, want="lora", staging=tmp_path / "stage", policy_version=3, where="trainer")


def test_stage_lora_ref_writes_a_peft_adapter(tmp_path):
    lora = build_tiny_lm(seed=0, finetune="lora", lora_rank=4, lora_alpha=8.0, lora_target_modules=("q_proj",))
    ref = CheckpointStore(str(tmp_path / "ckpt"), "run").save(2, weights=lora_state_dict(lora.module),
                                                               policy_version=2)
    with pytest.raises(ConfigError, match="lora_alpha"):
        stage_weights(ref, want="lora", staging=tmp_path / "stage", policy_version=2)
    out = stage_weights(ref, want="lora", staging=tmp_path / "stage", policy_version=2, lora_alpha=8.0)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"], cfg["peft_type"]) == (4, 8.0, ["q_proj"], "LORA")
    keys = safetensors.torch.load_file(str(out / "adapter_model.safetensors")).keys()
    assert keys and all(k.startswith("base_model.model.model.layers.") for k in keys)
    with pytest.raises(ConfigError, match="weight_sync='lora'"):  # an adapter sent to a full-reload engine
        stage_weights(out, want="full", staging=tmp_path / "s", policy_version=2)


class _Method:
    def __init__(self):
        self.calls = 0

    def process_weights_after_loading(self, layer):
        self.calls += 1


class _TiedLM(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.config = type("C", (), {"tie_word_embeddings": tie})()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(5, 3)
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.lm_head.quant_method = _Method()


def test_worker_extension_reties_and_reprocesses_the_head():
    m = _TiedLM(tie=True)
    assert _refresh_tied_lm_head(m)
    assert m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.quant_method.calls == 1
    assert _refresh_tied_lm_head(m) and m.lm_head.quant_method.calls == 2  # always rebuilds derived state
    untied = _TiedLM(tie=False)
    assert not _refresh_tied_lm_head(untied) and untied.lm_head.quant_method.calls == 0


def test_managed_server_starts_stops_and_reports_early_exit(tmp_path):
    port = reserve_port()
    client = HTTPJSONClient(f"http://127.0.0.1:{port}", timeout_s=5)
    srv = ManagedServer([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], env={},
                        name="web", log_dir=str(tmp_path))
    srv.start(client, health_path="/", timeout_s=60)
    assert srv.alive()
    srv.stop()
    assert not srv.alive() and not client.is_healthy("/")
    dead = ManagedServer([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], env={}, name="dead",
                         log_dir=str(tmp_path))
    with pytest.raises(EngineError, match=r"(?s)dead\.exit_code=3.*boom"):
        dead.start(client, health_path="/", timeout_s=60)


def test_managed_server_death_under_load_carries_the_log(tmp_path):
    port = reserve_port()
    client = HTTPJSONClient(f"http://127.0.0.1:{port}", timeout_s=5)
    srv = ManagedServer([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], env={},
                        name="web", log_dir=str(tmp_path))
    srv.start(client, health_path="/", timeout_s=60)
    srv.raise_if_dead()  # alive: nothing to report
    srv._proc.kill()
    srv._proc.wait()
    with pytest.raises(EngineError, match="died while serving"):
        srv.raise_if_dead()
    srv.stop()


_OWNER = """
import sys
from unirl_core.rollout.server import HTTPJSONClient, ManagedServer, reserve_port
port = reserve_port()
srv = ManagedServer([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], env={}, name="web",
                    log_dir=sys.argv[1])
srv.start(HTTPJSONClient(f"http://127.0.0.1:{port}", timeout_s=5), health_path="/", timeout_s=60)
srv.stop_with_parent(grace_s=5)
print(srv.pid, port, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_a_server_does_not_outlive_its_sigkilled_owner(tmp_path):
    """The pool's engine actor can die by SIGKILL (ray.kill, the OOM killer): its server, a session of its own,
    is stopped by the watchdog ``stop_with_parent`` started."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        pid, port = map(int, owner.stdout.readline().split())
        client = HTTPJSONClient(f"http://127.0.0.1:{port}", timeout_s=5)
        assert client.is_healthy("/")
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 20
        while client.is_healthy("/") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_healthy("/")
        with pytest.raises(ProcessLookupError):
            for _ in range(50):  # reaped by init once it exits
                os.killpg(pid, 0)
                time.sleep(0.2)
    finally:
        owner.kill()
