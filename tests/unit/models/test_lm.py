"""LM bundle: offline tokenizers, tiny preset save/load, reference policy, replay layout."""

import pytest
import torch

from unirl_core.errors import ConfigError, InvariantError
from unirl_core.models.lm import LMConfig, build_layout, build_tiny_lm, load_lm, replay_log_probs, save_tiny_lm
from unirl_core.models.lora import has_lora
from unirl_core.models.tokenizer import QWEN25_LEN, build_tiny_tokenizer, qwen25_tokenizer
from unirl_core.types import TokenSegment
from tests.unit.models.round_trip import assert_outputs_close, assert_same_weights


@pytest.fixture(scope="module")
def bundle():
    return build_tiny_lm(seed=0)


def _seg(prompt, response, logps=None, mask=None):
    r = torch.tensor(response, dtype=torch.int64)
    return TokenSegment(prompt_ids=torch.tensor(prompt, dtype=torch.int64), response_ids=r,
                        log_probs=torch.tensor(logps if logps is not None else [0.0] * len(response)),
                        response_mask=torch.tensor(mask if mask is not None else [True] * len(response)))


def test_tiny_tokenizer_is_deterministic_and_spells_digits():
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    ids = a("123 + 45", add_special_tokens=False)["input_ids"]
    assert [a.decode([i]) for i in ids if a.decode([i]).strip().isdigit()] == ["1", "2", "3", "4", "5"]
    text = a.apply_chat_template([{"role": "user", "content": "1 + 2 ="}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n1 + 2 =<|im_end|>\n<|im_start|>assistant\n"
    assert a.decode(a(text, add_special_tokens=False)["input_ids"]) == text


def test_qwen25_tokenizer_from_offline_wheel():
    tok = qwen25_tokenizer()
    assert len(tok) == QWEN25_LEN
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_preset_is_seeded(bundle):
    again = build_tiny_lm(seed=0)
    other = build_tiny_lm(seed=1)
    sd, sd2, sd3 = bundle.module.state_dict(), again.module.state_dict(), other.module.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not all(torch.equal(sd[k], sd3[k]) for k in sd)
    assert bundle.module.get_input_embeddings().num_embeddings == len(bundle.tokenizer)


def test_save_tiny_lm_loads_with_auto_classes(tmp_path, bundle):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_tiny_lm(tmp_path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == len(bundle.tokenizer) and tok.chat_template == bundle.tokenizer.chat_template
    assert_same_weights(model, bundle.module)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # two module instances: equal weights, outputs equal up to kernel choice
        assert_outputs_close(model(ids).logits, bundle.module(ids).logits)
    loaded = load_lm(LMConfig(model=str(tmp_path)))
    assert loaded.eos_token_ids == bundle.eos_token_ids


def test_full_finetune_reference_is_frozen_copy(bundle):
    ids = torch.tensor([[5, 6, 7]])
    b = build_tiny_lm(seed=0)
    with torch.no_grad():
        before = b.module(ids).logits
        for p in b.module.parameters():
            p.add_(0.01)
        with b.reference():
            ref = b.module(ids).logits
        after = b.module(ids).logits
    assert torch.equal(ref, before) and not torch.equal(after, before)
    assert not any(p.requires_grad for p in b._reference.parameters())


def test_lora_reference_disables_adapters_and_save_merges(tmp_path):
    from transformers import AutoModelForCausalLM

    b = build_tiny_lm(seed=0, finetune="lora", lora_rank=4)
    assert has_lora(b.module)
    trainable = [n for n, p in b.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        base = b.module(ids).logits
        for n, p in b.module.named_parameters():
            if "lora_B" in n:
                p.normal_()
        tuned = b.module(ids).logits
        with b.reference():
            ref = b.module(ids).logits
    assert torch.equal(ref, base) and not torch.allclose(tuned, base)
    b.save_pretrained(tmp_path)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not has_lora(merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, tuned, atol=1e-5, rtol=1e-5)


def test_keep_reference_false_raises_on_reference():
    b = build_tiny_lm(seed=0, keep_reference=False)
    with pytest.raises(ConfigError, match="keep_reference"):
        with b.reference():
            pass


def test_build_layout_pads_prompts_left_and_responses_right():
    lay = build_layout([_seg([1, 2, 3], [4, 5], [-0.5, -0.25]), _seg([6], [7, 8, 9], mask=[True, False, True])],
                       [1.0, 0.5], pad_id=0)
    assert lay.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 6, 7, 8, 9]]
    assert lay.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert lay.targets.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert lay.valid.tolist() == [[True, True, False], [True, True, True]]
    assert lay.loss_mask.tolist() == [[True, True, False], [True, False, True]]
    assert lay.stored_log_probs.tolist() == [[-0.5, -0.25, 0.0], [0.0, 0.0, 0.0]]
    with pytest.raises(InvariantError):
        build_layout([_seg([1], [])], [1.0], pad_id=0)


def test_replay_matches_manual_forward_and_zeroes_padding(bundle):
    segs = [_seg([10, 11, 12], [13, 14]), _seg([20], [21, 22, 23])]
    lay = build_layout(segs, [1.0, 0.5], pad_id=bundle.pad_token_id)
    with torch.no_grad():
        logp, ent = replay_log_probs(bundle.module, lay, with_entropy=True)
        # Row 1 alone, unpadded: logits at positions 0..2 predict 21, 22, 23 under T = 0.5.
        logits = bundle.module(torch.tensor([[20, 21, 22, 23]])).logits[0, :3].float() / 0.5
    want = torch.log_softmax(logits, -1).gather(-1, torch.tensor([[21], [22], [23]])).squeeze(-1)
    torch.testing.assert_close(logp[1], want, atol=1e-5, rtol=1e-5)
    assert logp[0, 2] == 0 and ent[0, 2] == 0 and bool((ent[:, :2] > 0).all())
