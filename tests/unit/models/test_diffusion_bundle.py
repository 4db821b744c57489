import pytest
import torch

from unirl_core.errors import ConfigError
from unirl_core.models.diffusion import LORA_TARGETS, DiffusionBundle, DiffusionModelConfig, LoRASpec
from unirl_core.models.diffusion_tiny import char_tokenizer, tiny_sd3_pipeline
from tests.unit.models.round_trip import assert_outputs_close, assert_same_weights

SIGMA = torch.tensor(0.6)


def _conds(bundle, n=2, neg=False):
    per = bundle.encode_text([f"prompt {i}" for i in range(n)])
    conds = {k: torch.stack([c[k] for c in per]) for k in per[0]}
    if neg:
        empty = bundle.encode_text([""])[0]
        conds.update({"negative_" + k: v.expand(n, *v.shape) for k, v in empty.items()})
    return conds


def _perturb(module):
    with torch.no_grad():
        for n, p in module.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))


def test_char_tokenizer_is_deterministic_and_offline():
    tok = char_tokenizer()
    ids = tok(["ab"]).input_ids[0]
    assert ids == [1, 4 + ord("a") - 32, 4 + ord("b") - 32, 3]
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


@pytest.mark.parametrize("source,family,seq,channels", [("tiny-sd3", "sd3", 77 + 32, 4),
                                                        ("tiny-sd35", "sd3", 77 + 32, 16),
                                                        ("tiny-flux", "flux", 32, 4),
                                                        ("tiny-flux-guidance", "flux", 32, 4)])
def test_tiny_presets_shapes_and_lora_reference(source, family, seq, channels):
    b = DiffusionBundle.build(DiffusionModelConfig(source=source))
    assert b.family == family
    assert b.latent_shape(64, 64) == (channels, 8, 8)
    per = b.encode_text(["a cat"])
    assert per[0]["prompt_embeds"].shape[0] == seq and per[0]["pooled_prompt_embeds"].ndim == 1
    trainable = [n for n, p in b.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    if source == "tiny-sd35":  # SD3.5-Medium's block: MMDiT-X (a second, image-only attention) and q/k RMS norm
        block = b.pipeline.transformer.transformer_blocks[0]
        assert block.attn2 is not None and b.pipeline.transformer.config.qk_norm == "rms_norm"
    x = torch.randn(2, channels, 8, 8)
    conds = _conds(b, neg=True)
    base = b.guided_velocity(x, SIGMA, conds, guidance_scale=4.5)
    assert base.shape == x.shape and base.dtype == torch.float32
    _perturb(b.module)
    moved = b.guided_velocity(x, SIGMA, conds, guidance_scale=4.5)
    assert not torch.equal(moved, base)
    with b.reference():
        assert torch.equal(b.guided_velocity(x, SIGMA, conds, guidance_scale=4.5), base)
    png = b.decode_png(x)
    assert len(png) == 2 and png[0][:8] == b"\x89PNG\r\n\x1a\n"


def test_full_finetune_reference_is_frozen_copy():
    b = DiffusionBundle.build(DiffusionModelConfig(finetune="full"))
    assert all(p.requires_grad for p in b.module.parameters())
    x, conds = torch.randn(2, 4, 8, 8), _conds(b)
    base = b.guided_velocity(x, SIGMA, conds, guidance_scale=1.0)
    _perturb(b.module)
    with b.reference():
        assert torch.equal(b.guided_velocity(x, SIGMA, conds, guidance_scale=1.0), base)
    assert not torch.equal(b.guided_velocity(x, SIGMA, conds, guidance_scale=1.0), base)
    no_ref = DiffusionBundle.build(DiffusionModelConfig(finetune="full", reference_copy=False))
    with pytest.raises(ConfigError, match="reference_copy"), no_ref.reference():
        pass


def test_cfg_combines_branches():
    b = DiffusionBundle.build(DiffusionModelConfig())
    x, conds = torch.randn(2, 4, 8, 8), _conds(b, neg=True)
    v_c = b.velocity(x, SIGMA, {k: conds[k] for k in ("prompt_embeds", "pooled_prompt_embeds")}).float()
    v_u = b.velocity(x, SIGMA, {k: conds["negative_" + k] for k in ("prompt_embeds", "pooled_prompt_embeds")}).float()
    torch.testing.assert_close(b.guided_velocity(x, SIGMA, conds, guidance_scale=3.0), v_u + 3.0 * (v_c - v_u))
    assert b.guidance_uses_negative(3.0) and not b.guidance_uses_negative(1.0)


def _assert_round_trip(loaded, preset):
    """A pipeline loaded from save_pretrained output is the preset it was saved from: bitwise-equal weights in
    every module, outputs within a tolerance (see tests/unit/models/round_trip.py for why not bitwise)."""
    components = [n for n, m in preset.pipeline.components.items() if isinstance(m, torch.nn.Module)]
    assert {"transformer", "vae", "text_encoder"} <= set(components)
    for name in components:
        # LoRA adapters are attached after loading, not part of the round trip; lora_B starts at zero, so
        # they leave the outputs below unchanged.
        assert_same_weights(getattr(loaded.pipeline, name), getattr(preset.pipeline, name), skip="lora_", what=name)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        got = loaded.guided_velocity(x, SIGMA, _conds(loaded, 1), guidance_scale=1.0)
        want = preset.guided_velocity(x, SIGMA, _conds(preset, 1), guidance_scale=1.0)
    assert_outputs_close(got, want)  # measured on an AMD EPYC: max abs diff 4.8e-7 (SD3), 2.4e-7 (Flux)


def test_from_pretrained_path_loads_a_saved_pipeline(tmp_path):
    tiny_sd3_pipeline(seed=0).save_pretrained(tmp_path / "sd3")
    loaded = DiffusionBundle.build(DiffusionModelConfig(source=str(tmp_path / "sd3"), max_sequence_length=32))
    preset = DiffusionBundle.build(DiffusionModelConfig(source="tiny-sd3"))
    assert loaded.family == "sd3"
    _assert_round_trip(loaded, preset)


def test_family_lora_targets_exist_and_config_errors():
    for fam, source in (("sd3", "tiny-sd3"), ("flux", "tiny-flux")):
        names = [n for n, _ in DiffusionBundle.build(DiffusionModelConfig(source=source, finetune="full"))
                 .module.named_modules()]
        for t in LORA_TARGETS[fam]:
            assert any(n.endswith("." + t) for n in names), (fam, t)
    with pytest.raises(ConfigError, match="dropout"):
        LoRASpec(dropout=0.1)
    with pytest.raises(ConfigError, match="dtype"):
        DiffusionModelConfig(dtype="float64")
    with pytest.raises(ConfigError, match="height"):
        DiffusionBundle.build(DiffusionModelConfig()).latent_shape(72, 64)


def test_transformer_only_bundle_matches_full_and_refuses_text():
    full = DiffusionBundle.build(DiffusionModelConfig(finetune="full", reference_copy=False))
    conds = _conds(full)
    x = torch.randn(2, 4, 8, 8)
    want = full.guided_velocity(x, SIGMA, conds, guidance_scale=1.0)
    only = DiffusionBundle.from_transformer(tiny_sd3_pipeline(seed=0).transformer, family="sd3",
                                            config=DiffusionModelConfig(source="tiny-sd3"))
    assert only.latent_shape(64, 64) == (4, 8, 8)
    assert torch.equal(only.guided_velocity(x, SIGMA, conds, guidance_scale=1.0), want)
    with pytest.raises(ConfigError, match="text encoders"):
        only.encode_text(["x"])
    with pytest.raises(ConfigError, match="VAE"):
        only.decode(x)


def test_from_pretrained_flux(tmp_path):
    from unirl_core.models.diffusion_tiny import tiny_flux_pipeline

    tiny_flux_pipeline(seed=0).save_pretrained(tmp_path / "flux")
    loaded = DiffusionBundle.build(DiffusionModelConfig(source=str(tmp_path / "flux"), max_sequence_length=32))
    preset = DiffusionBundle.build(DiffusionModelConfig(source="tiny-flux"))
    assert loaded.family == "flux"
    _assert_round_trip(loaded, preset)
