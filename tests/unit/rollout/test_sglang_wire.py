"""SGLang engine against a STAND-IN server speaking SGLang's documented HTTP wire format.

SGLang has no CPU build, so this checks only our side of the protocol: the requests the engine
sends (token ids, sampling params, return_logprob, lora_path, weight updates) and how it reads
the answers (output_token_logprobs, finish_reason, weight_version). It is not SGLang.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from unirl_core.errors import ConfigError, EngineError
from unirl_core.models.tokenizer import build_tiny_tokenizer
from unirl_core.rollout.sglang import SGLangEngine, SGLangEngineConfig
from unirl_core.rollout.sglang.engine import sampling_body, server_argv, server_env
from unirl_core.types import ARSamplingParams, PromptRecord, SampleBatch


class _StandIn:
    """State of the fake server: the weight version label and every request body it saw."""

    def __init__(self):
        self.version = "default"
        self.bodies: dict[str, list[dict]] = {}


def _handler(state: _StandIn):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, obj, code=200):
            raw = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            if self.path == "/health_generate":
                self._send({})
            elif self.path == "/get_model_info":
                self._send({"weight_version": state.version})
            else:
                self._send({"error": "no route"}, 404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.bodies.setdefault(self.path, []).append(body)
            if self.path == "/update_weight_version":
                state.version = body["new_version"]
                self._send({"success": True, "new_version": body["new_version"]})
            elif self.path == "/update_weights_from_disk":
                ok = body["model_path"].endswith("good")
                if ok:
                    state.version = body["weight_version"]
                self._send({"success": ok, "message": "loaded" if ok else "shape mismatch"}, 200 if ok else 400)
            elif self.path == "/generate":
                n = body["sampling_params"]["max_new_tokens"]
                first = body["input_ids"][-1] % 50
                triples = [[-0.5 - 0.1 * i, 10 + first + i, None] for i in range(n)]
                self._send({"text": "x", "output_ids": [t[1] for t in triples],
                            "meta_info": {"output_token_logprobs": triples, "weight_version": state.version,
                                          "finish_reason": {"type": "length", "length": n}}})
            else:
                self._send({"success": True})
    return H


@pytest.fixture()
def standin():
    state = _StandIn()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield state, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _batch():
    recs = [PromptRecord(prompt_id=f"p{i}", prompt=f"{i} + 1 =") for i in range(2)]
    return SampleBatch.from_prompts(recs, samples_per_prompt=2, kind="ar",
                                    sampling=ARSamplingParams(max_new_tokens=3, temperature=0.9, seed=1))


def test_generate_and_publish_over_the_wire(standin, tmp_path):
    state, url = standin
    tok = build_tiny_tokenizer()
    eng = SGLangEngine(SGLangEngineConfig(model="tiny", base_url=url), policy_version=4, tokenizer=tok)
    assert state.version == "4" and eng.served_version() == 4
    out = eng.generate(_batch())
    sent = state.bodies["/generate"]
    assert len(sent) == 4 and all(b["return_logprob"] and b["logprob_start_len"] == -1 for b in sent)
    assert len({b["sampling_params"]["sampling_seed"] for b in sent}) == 4  # siblings get their own seeds
    by_sample = {b["rid"].split("@")[0]: b for b in sent}
    for part in out.generated:
        seg, body = part.segment, by_sample[part.sample_id]
        assert part.policy_version == 4 and seg.finish_reason == "length"
        assert seg.prompt_ids.tolist() == body["input_ids"]
        assert seg.response_ids.tolist() == [10 + body["input_ids"][-1] % 50 + i for i in range(3)]
        assert seg.log_probs.tolist() == pytest.approx([-0.5, -0.6, -0.7])
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "model.safetensors").write_bytes(b"")
    eng.update_weights(tmp_path / "good", 5)
    assert state.bodies["/update_weights_from_disk"][-1]["weight_version"] == "5"
    assert {p.policy_version for p in eng.generate(_batch()).generated} == {5}
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
    with pytest.raises(EngineError, match="shape mismatch"):
        eng.update_weights(tmp_path / "bad", 6)
    state.version = "9"  # someone else relabelled the server: rollouts must not be trusted
    with pytest.raises(EngineError, match="served policy_version"):
        eng.generate(_batch())
    with pytest.raises(EngineError, match="sglang.colocate"):
        eng.sleep()


def test_sglang_flags_and_config():
    sp = ARSamplingParams(top_k=0, max_new_tokens=4, stop=("\n",))
    assert sampling_body(sp, None) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4,
                                       "stop": ["\n"]}
    argv = " ".join(server_argv(SGLangEngineConfig(model="m", colocate=True, weight_sync="lora",
                                                   mem_fraction_static=0.4), "py", 31000))
    for flag in ("-m sglang.launch_server", "--model-path m", "--port 31000", "--enable-memory-saver",
                 "--mem-fraction-static 0.4", "--enable-lora", "--lora-target-modules q_proj"):
        assert flag in argv
    with pytest.raises(EngineError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        server_env(SGLangEngineConfig(model="m", env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}))
    with pytest.raises(ConfigError, match="sglang.mem_fraction_static"):
        SGLangEngineConfig(model="m", mem_fraction_static=1.5)
