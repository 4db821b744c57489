"""CLIP-family scorers load with from_pretrained and compute their formulas (tiny random-init CLIP)."""

import io

import pytest
import torch
from tests.unit.reward.reward_images import flat_png, noise_png

from unirl_core.errors import ConfigError
from unirl_core.reward import ScoreItem, build_scorer
from unirl_core.reward.scorers.clip import AestheticHead

ITEMS = [ScoreItem(prompt="a purple square", media=flat_png()),
         ScoreItem(prompt="television static noise, very detailed", media=noise_png(1))]


@pytest.fixture(scope="module")
def reference(tiny_clip_dir):
    """Cosine of each image with its prompt from CLIPModel's own forward (an independent path)."""
    from PIL import Image
    import io
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    proc = CLIPProcessor.from_pretrained(tiny_clip_dir)
    images = [Image.open(io.BytesIO(it.media)).convert("RGB") for it in ITEMS]
    batch = proc(text=[it.prompt for it in ITEMS], images=images, return_tensors="pt", padding=True,
                 truncation=True, max_length=32)
    with torch.no_grad():
        out = model(**batch)
    cos = (out.image_embeds * out.text_embeds).sum(-1)
    return {"cos": cos, "scale": float(model.logit_scale.detach().exp()), "image_embeds": out.image_embeds}


def test_pickscore(tiny_clip_dir, reference):
    got = build_scorer("pickscore", model=tiny_clip_dir, processor=tiny_clip_dir, divisor=26.0)(ITEMS)
    assert got == pytest.approx((reference["cos"] * reference["scale"] / 26.0).tolist(), abs=1e-5)


def test_hpsv2_and_clip_score(tiny_clip_dir, reference):
    hps = build_scorer("hpsv2", model=tiny_clip_dir)(ITEMS)
    assert hps == pytest.approx(reference["cos"].tolist(), abs=1e-5)
    clip = build_scorer("clip_score", model=tiny_clip_dir, w=2.5)(ITEMS)
    assert clip == pytest.approx((2.5 * reference["cos"].clamp(min=0)).tolist(), abs=1e-5)


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_aesthetic_head_from_local_file(tiny_clip_dir, reference, tmp_path, suffix):
    torch.manual_seed(3)
    head = AestheticHead(in_dim=16).eval()
    path = tmp_path / f"head{suffix}"
    if suffix == ".pth":
        torch.save(head.state_dict(), path)
    else:
        from safetensors.torch import save_file
        save_file(head.state_dict(), str(path))
    got = build_scorer("aesthetic", head=str(path), model=tiny_clip_dir)(ITEMS)
    with torch.no_grad():
        want = head(reference["image_embeds"]).tolist()
    assert got == pytest.approx(want, abs=1e-5)
    assert sorted(head.state_dict()) == [f"layers.{i}.{p}" for i in (0, 2, 4, 6, 7) for p in ("bias", "weight")]


def test_aesthetic_missing_head(tiny_clip_dir, tmp_path):
    with pytest.raises(ConfigError, match="aesthetic head"):
        build_scorer("aesthetic", head=str(tmp_path / "missing.pth"), model=tiny_clip_dir)


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_aesthetic_head_from_an_fsspec_uri(tiny_clip_dir, reference, tmp_path, scheme):
    """A head by URI (hf://<repo>/<file>, https://, s3:// read the same way through fsspec), here without network."""
    import fsspec

    torch.manual_seed(4)
    head = AestheticHead(in_dim=16).eval()
    buf = io.BytesIO()
    torch.save(head.state_dict(), buf)
    uri = f"memory://heads/{tmp_path.name}/head.pth" if scheme == "memory" else f"file://{tmp_path}/head.pth"
    with fsspec.open(uri, "wb") as f:
        f.write(buf.getvalue())
    got = build_scorer("aesthetic", head=uri, model=tiny_clip_dir)(ITEMS)
    with torch.no_grad():
        assert got == pytest.approx(head(reference["image_embeds"]).tolist(), abs=1e-5)
    with pytest.raises(ConfigError, match="aesthetic head.*fsspec URI"):
        build_scorer("aesthetic", head="memory://heads/none.pth", model=tiny_clip_dir)


def test_sd35m_pickscore_divides_by_flow_grpos_26(tiny_clip_dir, reference):
    """flow_grpo's PickScoreScorer returns ``logit_scale.exp() * cos / 26`` ("norm to 0-1"); the recipe does too."""
    from unirl_core.config.recipes import load_recipe

    (component,) = [c for c in load_recipe("sd35m-pickscore").reward.components if c.name == "pickscore"]
    assert component.kwargs["divisor"] == 26.0
    kwargs = {**component.kwargs, "model": tiny_clip_dir, "processor": tiny_clip_dir, "device": "cpu",
              "dtype": "float32"}
    got = build_scorer("pickscore", **kwargs)(ITEMS)
    assert got == pytest.approx((reference["cos"] * reference["scale"] / 26.0).tolist(), abs=1e-5)
